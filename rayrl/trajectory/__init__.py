"""Turn-node trajectory trees: routing of recorded turns, token-faithful linearization into Samples.

``TrajectoryTree`` (tree.py) records turns; ``linearize`` (linearize.py) turns a tree into Samples;
``messages_equal`` (messages.py) is the one definition of "same message" used for routing;
``TreeEvent`` (events.py) is what a debug callback receives.
"""

from rayrl.trajectory.drift import DriftInfo, DriftKind, SessionClosedError, TITODriftError
from rayrl.trajectory.events import TreeEvent
from rayrl.trajectory.linearize import dump_samples, linearize
from rayrl.trajectory.messages import messages_equal, routing_view
from rayrl.trajectory.tree import TrajectoryTree

__all__ = [
    "DriftInfo",
    "DriftKind",
    "SessionClosedError",
    "TITODriftError",
    "TrajectoryTree",
    "TreeEvent",
    "dump_samples",
    "linearize",
    "messages_equal",
    "routing_view",
]
