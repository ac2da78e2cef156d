"""Memory occupation as SGLang 0.5.9 serves it: the tags, the one check of a request's ``tags``, and the CPU
engine's release/resume.

``/release_memory_occupation`` and ``/resume_memory_occupation`` take ``tags`` (null: all) from SGLang's
three regions; every engine that serves them (the CPU engine here, the vLLM adapter) checks them with
:func:`check_memory_tags`, so an unknown tag is a 400 everywhere and never a silent no-op. SGLang asserts
that no request is running when it releases memory, and its scheduler dies on that assertion: the CPU engine
refuses such a release (:class:`EngineBusy`), so a caller that skips the idle wait fails a test on CPU.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class EngineBusy(ValueError):
    """A call that needs an idle engine (memory release) came with requests running or waiting."""


def check_memory_tags(tags: Any, error: type[ValueError] = ValueError) -> list[str]:
    """``tags`` as a list of known tag names (None: all of them); ``error`` names what is wrong otherwise."""
    if tags is None:
        return list(MEMORY_TAGS)
    if not isinstance(tags, (list, tuple)) or not all(isinstance(t, str) for t in tags):
        raise error("tags must be null or a list of strings")
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise error(f"unknown memory tag(s) {unknown}; valid: {', '.join(MEMORY_TAGS)}")
    return list(tags)


class MemoryOccupationMixin:
    """The CPU engine's release/resume (a mixin of :class:`rayrl.engines.cpu_engine.CPUEngine`): on CPU the
    state is recorded (``stats()["released_memory"]``), with SGLang's rules on when a release may come."""

    _released: set[str]

    def release_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        """Records the state (on GPU this frees weights/KV memory for the trainer); releasing
        ``kv_cache`` also empties the prefix cache, as it does in SGLang."""
        tags = check_memory_tags(tags)
        if not self.idle():  # SGLang 0.5.9 asserts this in its scheduler, which then dies
            stats = self.stats()
            raise EngineBusy(f"release_memory_occupation should be called only when no ongoing request: "
                             f"{stats['running']} running, {stats['waiting']} waiting (wait until /flush_cache "
                             "succeeds first)")
        self._released.update(tags)
        if "kv_cache" in tags:
            self._call_in_loop(self._flush_prefix_cache)

    def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        """CPU no-op counterpart of :meth:`release_memory_occupation` (weights stay valid on CPU)."""
        self._released.difference_update(check_memory_tags(tags))
