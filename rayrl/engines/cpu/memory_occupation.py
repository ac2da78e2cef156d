"""The CPU engine's memory release and resume, as SGLang 0.5.9 serves them.

``/release_memory_occupation`` and ``/resume_memory_occupation`` take ``tags`` (null: all) from SGLang's
three regions, checked by the API's one check (rayrl/engines/api.py :func:`check_memory_tags`), so an
unknown tag is a 400 everywhere and never a silent no-op. SGLang asserts that no request is running when it
releases memory, and its scheduler dies on that assertion: the CPU engine refuses such a release
(:class:`EngineBusy`), so a caller that skips the idle wait fails a test on CPU.
"""

from __future__ import annotations

from typing import Optional, Sequence

from rayrl.engines.api import check_memory_tags


class EngineBusy(ValueError):
    """A call that needs an idle engine (memory release) came with requests running or waiting."""


class MemoryOccupationMixin:
    """The CPU engine's release/resume (a mixin of :class:`rayrl.engines.cpu.engine.CPUEngine`): on CPU the
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
