"""Flattened weight buckets for an install without SGLang (the CPU path): the same byte layout as SGLang's.

SGLang's ``sglang.srt.weight_sync.tensor_bucket`` (0.5.9, the pinned version) lays a bucket out as the
bytes of each tensor back to back in one uint8 tensor, with one ``FlattenedTensorMetadata`` per tensor
(name, shape, dtype, and its byte range). rayrl.weights.wire uses SGLang's own classes whenever SGLang is
importable, because SGLang's unpickler admits no other class. Where it is not (a CPU-only install, which
only talks to rayrl's CPU engine), these two classes stand in: same fields, same layout, same methods,
so a bucket built either way is cut apart the same way. tests/contracts/ checks the two against each
other with the pinned SGLang installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class FlattenedTensorMetadata:
    """Where one tensor's bytes lie in a flattened bucket (SGLang's fields; ``numel`` counts bytes)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    """Tensors of any dtypes as one uint8 tensor plus the metadata to cut them apart again."""

    def __init__(
        self,
        named_tensors: Optional[Sequence[tuple[str, torch.Tensor]]] = None,
        flattened_tensor: Optional[torch.Tensor] = None,
        metadata: Optional[list[FlattenedTensorMetadata]] = None,
    ) -> None:
        if named_tensors is not None:
            if not named_tensors:
                raise ValueError("a bucket holds at least one tensor")
            parts, self.metadata, offset = [], [], 0
            for name, tensor in named_tensors:
                flat = tensor.detach().flatten().view(torch.uint8)
                self.metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, offset,
                                                             offset + flat.numel(), flat.numel()))
                parts.append(flat)
                offset += flat.numel()
            self.flattened_tensor = torch.cat(parts)
        elif flattened_tensor is not None and metadata is not None:
            self.flattened_tensor, self.metadata = flattened_tensor, list(metadata)
        else:
            raise ValueError("give named_tensors, or flattened_tensor and metadata")

    def get_flattened_tensor(self) -> torch.Tensor:
        return self.flattened_tensor

    def get_metadata(self) -> list[FlattenedTensorMetadata]:
        return self.metadata

    def reconstruct_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` views into the flattened tensor, in bucket order."""
        return [(m.name, self.flattened_tensor[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape))
                for m in self.metadata]
