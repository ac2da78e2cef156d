"""The CPU engine's weights: which decode path holds them in which format, and how they change.

A mixin of :class:`rayrl.engines.cpu.engine.CPUEngine`, kept apart from the request API and the loop
because it is one concern: the model's parameters (what prefill reads), the lean decode path's copy of
them (lean_decode.py, in ``engine.weight_format``: weight_formats.py) and the version every generated
token is stamped with. Every change runs as a command on the engine thread between decode steps
(``_call_in_loop``): the copy into the model, the rebuilding of the packed weights from it and the new
version land together, so no decode step sees half-updated packed weights. Packing seconds are
counted (``weight_pack_seconds``, ``weight_packs``) for the step metrics.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from rayrl.engines.cpu.lean_decode import LeanDecoder, unsupported_reason
from rayrl.engines.cpu.weight_formats import WEIGHT_FORMATS, check_weight_format, fp16_packing_available
from rayrl.weights.files import read_checkpoint
from rayrl.weights.wire import WeightUpdateError, copy_into

logger = logging.getLogger("rayrl.engines.cpu.engine")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class WeightsMixin:
    """Weight format, updates and version (mixed into CPUEngine)."""

    model: Any
    dtype: str
    device: torch.device
    context_length: int
    _lean: Optional[LeanDecoder]
    _params: dict[str, torch.Tensor]
    _stale_packed: set[str]  # weights changed since the lean path packed them (_repack_stale)
    _counters: Any
    _weight_version: str
    _flush_prefix_cache: Any

    def _lean_decoder(self, weight_format: str) -> Optional[LeanDecoder]:
        """The lean decode path in ``weight_format`` ("auto" resolved here), or None where it cannot run
        this model (then decoding goes through transformers, with float32 weights)."""
        reason = unsupported_reason(self.model, self.device)
        if reason is None and self.dtype != "float32":
            reason = f"the lean path computes in float32 (engine dtype {self.dtype})"
        if weight_format == "auto":
            weight_format = "fp16-packed" if reason is None and fp16_packing_available() else "float32"
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be auto or one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
        if reason is not None:
            if weight_format != "float32":
                raise ValueError(f"weight_format {weight_format} needs the lean decode path, which cannot run "
                                 f"this model: {reason}")
            logger.info("decoding through transformers: %s", reason)
            return None
        check_weight_format(weight_format, DTYPES[self.dtype], self.device)
        lean = LeanDecoder(self.model, weight_format, self.context_length)
        self._counters["weight_load_pack_s"] = lean.pack_seconds
        logger.info("lean decode path, weights %s (packed in %.2f s), attention %s", weight_format, lean.pack_seconds,
                    lean.attention)
        return lean

    @property
    def weight_format(self) -> str:
        """How the decode path holds its weights now: float32 or fp16-packed."""
        return self._lean.weight_format if self._lean is not None else "float32"

    @property
    def weight_version(self) -> str:
        return self._weight_version

    def set_weight_version(self, version: str) -> None:
        """Rename the current weights' version (tokens generated from now on carry it)."""
        self._call_in_loop(lambda: self._set_version(str(version)))

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor], version: Optional[str] = None) -> int:
        """Copy ``named_tensors`` (HF names) into the model between decode steps; returns the count.

        Names and shapes are validated before anything is copied (WeightUpdateError, a ValueError).
        Dtypes are cast to the engine's. Running requests continue with the new weights and record
        per-token versions. Refused while a LoRA adapter is merged (engine_adapter.py: unload it first);
        otherwise the base copies a former adapter kept are dropped, since these weights replace them.
        """
        adapter = getattr(self, "_adapter", None)
        if adapter is not None:
            raise WeightUpdateError(f"LoRA adapter {adapter.name!r} is merged into the weights: unload it "
                                    "before loading full weights")
        getattr(self, "_adapter_base", {}).clear()
        return self._replace_weights(named_tensors, version)

    def _replace_weights(self, named_tensors: Mapping[str, torch.Tensor], version: Optional[str] = None,
                         repack_now: bool = True) -> int:
        """Copy ``named_tensors`` into the model and the packed decode weights, between decode steps.

        ``repack_now=False`` leaves the packed copies of these weights to be rebuilt before the next
        prefill or decode step (:meth:`_repack_stale`), or by the next update that repacks anyway: an
        adapter update unloads (the base back) and loads (the base plus the new adapter) the same
        matrices, and one repack of them is enough."""

        def apply() -> int:
            count = copy_into(named_tensors, self._params)
            if self._lean is not None:
                self._stale_packed.update(named_tensors)
                if repack_now:
                    self._repack_stale()
            self._flush_prefix_cache()
            if version is not None:
                self._set_version(str(version))
            return count

        return self._call_in_loop(apply)

    def _repack_stale(self) -> None:
        """Rebuild the packed decode weights of every weight changed since they were packed (engine thread)."""
        if self._stale_packed and self._lean is not None:
            self._counters["weight_pack_s"] += self._lean.repack(self._stale_packed)
            self._counters["weight_packs"] += 1
        self._stale_packed.clear()

    def set_weight_format(self, weight_format: str) -> float:
        """Hold the decode weights in ``weight_format`` from the next decode step on (packed between
        steps); returns the seconds the packing took. Raises ValueError where it cannot run."""
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
        lean = self._lean
        if lean is None:
            if weight_format == "float32":
                return 0.0
            raise ValueError(f"weight_format {weight_format} needs the lean decode path, which this engine "
                             "does not run (it decodes through transformers)")
        check_weight_format(weight_format, DTYPES[self.dtype], self.device)
        if weight_format == lean.weight_format:
            return 0.0

        def apply() -> float:
            seconds = lean.pack(weight_format)  # every weight, from the model's current ones
            self._stale_packed.clear()
            self._counters["weight_pack_s"] += seconds
            self._counters["weight_packs"] += 1
            self._flush_prefix_cache()  # cached keys came from the other format's numbers
            return seconds

        seconds = self._call_in_loop(apply)
        logger.warning("decode weights are now %s (packed in %.2f s)", weight_format, seconds)
        return seconds

    def load_weights_from_disk(self, path: str | Path, version: Optional[str] = None) -> int:
        """Read a safetensors checkpoint (a directory of ``*.safetensors`` or one file) and apply it."""
        tensors = read_checkpoint(path, self._params)
        return self.update_weights(tensors, version)

