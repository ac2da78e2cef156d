"""The trainer's memory saver without a GPU: every call is a no-op that says so once in the log."""

from __future__ import annotations

import logging

import pytest
import torch

from rayrl.trainers.memory_saver import MemorySaver


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")
def test_no_op_on_cpu_with_a_clear_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="rayrl.trainers.memory_saver"):
        saver = MemorySaver(enabled=True)
    assert not saver.active
    assert "no CUDA device" in caplog.text
    with saver.region():
        w = torch.ones(4)
    with saver.outside():
        pass
    assert saver.pause() is False and saver.resume() is False and not saver.paused
    assert torch.equal(w, torch.ones(4))
    with caplog.at_level(logging.INFO, logger="rayrl.trainers.memory_saver"):
        MemorySaver(enabled=False)
    assert "memory saver off" in caplog.text
