"""How the run's parts fail, as the schedules, the engine membership and the checkpoints see it:
TrainerFailure (a trainer rank died) and WeightSyncError (a weight update to the engines failed)."""

from __future__ import annotations


class TrainerFailure(RuntimeError):
    """A trainer rank died or raised; the run must stop (replicas may have diverged).

    ``phase``: what the ranks were doing; ``errors``: rank -> cause; ``survivors``: rank -> policy version
    of every rank that still answers (the state each holds: a checkpoint can be written from one of them
    where every rank holds the full state).
    """

    def __init__(self, phase: str, errors: dict[int, str], survivors: dict[int, int]) -> None:
        self.phase = phase
        self.errors = errors
        self.survivors = survivors
        detail = "; ".join(f"rank {r}: {_bounded(e)}" for r, e in errors.items())
        super().__init__(f"trainer rank failure in {phase}: {detail}")


CAUSE_CHARS = 300  # the driver prints this message as its one line; ``errors`` keeps every cause whole


def _bounded(cause: str) -> str:
    """A rank's cause cut to :data:`CAUSE_CHARS` (transformers' "unrecognized model" lists ~400 model types)."""
    if len(cause) <= CAUSE_CHARS:
        return cause
    return f"{cause[:CAUSE_CHARS]}... ({len(cause) - CAUSE_CHARS} more characters)"


class WeightSyncError(RuntimeError):
    """A weight update to the engines failed or did not finish within ``pipeline.weight_sync_timeout_s``
    (raised by actors/weight_sync.py; the engine membership decides whether it goes again)."""
