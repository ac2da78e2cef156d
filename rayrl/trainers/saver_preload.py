"""The environment a GPU trainer rank is started with for torch_memory_saver's preload mode.

Why apart from rayrl/trainers/memory_saver.py: the driver reads this when it creates the trainer ranks
(actors/trainer.py), and the driver never needs torch, which the saver itself imports (seconds on a
small machine). memory_saver.py says why the ranks start with the preload rather than "torch" mode.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def preload_env(enabled: bool) -> dict[str, str]:
    """Environment a GPU trainer process must be started with for the saver: ``LD_PRELOAD`` set to
    torch_memory_saver's preload hook alone (the build for the installed torch's CUDA major). torch_memory_saver
    0.0.9 hands the whole ``LD_PRELOAD`` string to ``ctypes.CDLL`` (its hooks/mode_preload.py), so a preload
    already set (jemalloc, a profiler) cannot be kept: the ranks go without it, and a warning names it. Empty
    when the saver is off or the library is not installed here (the process then uses "torch" mode, with its
    exit status problem above, and a warning says so)."""
    if not enabled:
        return {}
    try:
        from torch_memory_saver.utils import get_binary_path_from_package
    except ImportError:
        logger.warning("memory saver: torch_memory_saver is not installed where the trainer ranks are made; "
                       "they use its torch hook mode, whose processes exit 1 at teardown")
        return {}
    hook = str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))
    others = [p for p in os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p and p != hook]
    if others:
        logger.warning("memory saver: the trainer ranks start with LD_PRELOAD=%s alone, without %s: "
                       "torch_memory_saver 0.0.9 loads the whole LD_PRELOAD value as one library", hook,
                       ":".join(others))
    return {"LD_PRELOAD": hook}
