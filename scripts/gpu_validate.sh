#!/usr/bin/env bash
# Run tests/gpu on the device machine (no network there) and leave the results under $OUT.
#
# Here, first:   bash scripts/fetch_gpu_wheels.sh          (fills the ignored .gpu-wheels/, ~20 MiB)
# Then, with the device tool:
#   run(command="bash scripts/gpu_validate.sh", carry=[".gpu-wheels"], timeout_s=600)
# Transformer Engine (optional, for the mbridge tests): fetch with --with-te, carry .gpu-wheels-te/parts
# in pieces over several calls into /tmp/te-parts on the warm machine, then run this script; it joins
# and installs them when they are all there.
#
# Results: $OUT/device.txt (date, GPU, versions), $OUT/pytest.log, $OUT/junit.xml, and the JSON figures
# the tests write ($OUT/ipc_transfer.json, $OUT/memory_saver.json).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
SITE=/tmp/rayrl-site
export PYTHONUNBUFFERED=1
if ls .gpu-wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .gpu-wheels/*.whl || exit 1
    for sdist in .gpu-wheels/*.tar.gz; do
        [ -e "$sdist" ] && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" "$sdist"
    done
else
    echo "no .gpu-wheels/ carried: only tests whose packages the image already has will run" >&2
fi
TE_PARTS=${TE_PARTS:-/tmp/te-parts}
if ls "$TE_PARTS"/*.part-* >/dev/null 2>&1; then
    whl=$(ls "$TE_PARTS"/*.part-00 | sed 's/\.part-00$//')
    cat "$TE_PARTS"/*.part-* > "/tmp/$(basename "$whl")"
    python3 -m pip install -q --no-index --no-deps --target "$SITE" "/tmp/$(basename "$whl")" "$TE_PARTS"/transformer_engine-*.whl
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
    date -u +"%Y-%m-%d %H:%M:%S UTC"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 - <<'PY'
import importlib
for name in ("torch", "megatron.core", "mbridge", "torch_memory_saver", "transformer_engine", "transformers"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "(no version)"))
    except Exception as err:  # noqa: BLE001 - report whatever stops the import
        print(name, "MISSING:", type(err).__name__, err)
PY
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
python3 -m pytest tests/gpu -m gpu -v -rs -p no:cacheprovider -o addopts="" --timeout=500 \
    --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.log"
exit "${PIPESTATUS[0]}"
