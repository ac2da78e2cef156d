"""A stand-in for the ``sglang`` package in tests (SGLang needs a GPU; this machine has none).

Only ``python -m sglang.launch_server`` exists: it parses SGLang's flags and serves the project's CPU
engine behind the same HTTP API, so the launcher's real command line, health wait, log capture and
teardown run unchanged. Put ``tests/engines/fake_sglang`` on PYTHONPATH to use it.
"""
