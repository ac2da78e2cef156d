"""The CPU engine's ``--device``: ``cpu`` unless asked (every other engine test runs that default), ``cuda``
or ``cuda:N`` for the CUDA IPC check of tests/gpu/test_gpu_engine_ipc.py; anything else is refused at
parse time, naming the flag, before a model is loaded."""

from __future__ import annotations

import pytest

from rayrl.engines.cpu.__main__ import parse_args


def test_device_defaults_to_cpu_and_takes_cuda_devices():
    assert parse_args(["--model-path", "m"]).device == "cpu"
    assert [parse_args(["--model-path", "m", "--device", d]).device for d in ("cuda", "cuda:1")] == ["cuda", "cuda:1"]


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "mps", ""])
def test_unknown_device_is_refused_naming_the_flag(device, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model-path", "m", "--device", device])
    assert exit_info.value.code == 2
    assert "--device must be cpu, cuda or cuda:N" in capsys.readouterr().err
