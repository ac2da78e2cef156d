"""How stale trained tokens are: policy versions between the weights about to train and the weights that
generated each token. The one home of the arithmetic; the async schedules' filter (rayrl/rl/groups.py),
the batch (rayrl/rl/batch.py) and the step metrics all read it from here.

Each response token carries the policy version that generated it (``Sample.policy_versions``: a
generation may span a weight update, so versions are per token); only trained tokens (``loss_mask`` 1)
count: context the model did not generate here is never trained, so its age does not matter.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from rayrl.types import Sample


def token_staleness(samples: Sequence[Sample], version: int) -> np.ndarray:
    """Per trained token, in sample order: ``version - policy_versions`` (int64)."""
    parts = [version - s.policy_versions[s.loss_mask.astype(bool)] for s in samples]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def sample_staleness(samples: Sequence[Sample], version: int) -> list[int]:
    """Per sample with trained tokens: ``version`` minus its oldest trained token's version."""
    return [version - v for s in samples if (v := s.oldest_version()) is not None]
