"""rayrl's own CPU engine: a transformers model with continuous batching behind SGLang's HTTP API.

``python -m rayrl.engines.cpu`` runs it as a process (``__main__.py``; the cpu backend's command,
rayrl/engines/backends/cpu.py). ``engine.py``: ``CPUEngine``, its request API and loop, with its mixins
(``prefill.py``, ``decode.py``, ``engine_weights.py``, ``engine_adapter.py``: a LoRA adapter merged into its
weights, ``memory_occupation.py``); ``requests.py`` and ``sampling.py``: a request's state and its sampling;
``kv_cache.py`` and ``prefix_cache.py``: the caches; ``lean_decode.py``: its own decode step, with
``decode_kernels.py`` + ``.cpp`` (C++ kernels built at load) and ``weight_formats.py`` (float32 or
fp16-packed weights). ``server.py``: ``EngineServer``, the HTTP server (``generate_request.py``: a
``/generate`` body read; ``weight_routes.py``: its weight endpoints). ``sglang_standin.py``: the same engine
behind the pinned SGLang 0.5.9's contract (``--strict-sglang``), with SGLang's own control code
(``sglang_control.py``).

What it shares with every engine stays one level up: the API it serves (rayrl/engines/api.py), the request
body checks (rayrl/engines/http_input.py). The weights it receives come through rayrl/weights, which it
imports; nothing outside this package imports it but the launcher's command line, the gateway's
in-process engine and the tests.
"""
