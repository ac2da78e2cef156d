"""The vllm backend's side of a vLLM server: ``python -m rayrl.engines.vllm.adapter`` serves rayrl's engine
API (rayrl/engines/api.py) over a real vLLM started as its child (``process.py``; ``requests.py``: the
request translations), and ``worker.py`` is rayrl's weight-transfer engine inside vLLM's workers
(docs/engines.md). Imported by its own process and vLLM's workers, not by the rest of rayrl.
"""
