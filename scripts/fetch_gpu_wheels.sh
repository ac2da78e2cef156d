#!/usr/bin/env bash
# Download the Python wheels tests/gpu needs on the device machine (no network there) into .gpu-wheels/.
#
#   bash scripts/fetch_gpu_wheels.sh            # megatron-core, mbridge, torch_memory_saver + what they need
#   bash scripts/fetch_gpu_wheels.sh --with-te  # also Transformer Engine's CUDA 13 core, split in <60 MiB parts
#
# The device image (docs: .library/device/KINDS.md) has Python 3.12, torch 2.11 (cu130), numpy 2, einops and
# safetensors, but transformers 5, no omegaconf and no Transformer Engine. So this fetches:
#   megatron-core 0.15.3, mbridge 0.15.1, torch_memory_saver 0.0.10 (ships cu12 and cu13 hooks),
#   transformers 4.57.1 + tokenizers 0.22.1 + huggingface_hub 0.36.0 (rayrl and mbridge use transformers 4),
#   omegaconf 2.3.0 + antlr4-python3-runtime 4.9.3 (an sdist: pure Python, built offline there).
# One device call carries at most 64 MiB; the script fails if the core set is larger.
# Transformer Engine's torch extension (transformer_engine_torch) is published only as an sdist whose
# metadata step needs nvcc, so pip cannot download it here: without it the mbridge tests skip (see docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.gpu-wheels
PY="python3 -m pip"
[ -x .venv/bin/python ] && PY=".venv/bin/python -m pip"
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
rm -rf "$DEST" && mkdir -p "$DEST"
$PY download -q --no-deps "${PLATFORM[@]}" -d "$DEST" \
    megatron-core==0.15.3 mbridge==0.15.1 torch_memory_saver==0.0.10 \
    transformers==4.57.1 tokenizers==0.22.1 huggingface_hub==0.36.0 omegaconf==2.3.0
$PY download -q --no-deps --no-binary=:all: -d "$DEST" antlr4-python3-runtime==4.9.3
bytes=$(du -cb "$DEST"/* | tail -1 | cut -f1)
echo "core wheels in $DEST: $(ls "$DEST" | wc -l) files, $((bytes / 1024 / 1024)) MiB ($bytes bytes)"
ls -la "$DEST"
if [ "$bytes" -ge $((64 * 1024 * 1024)) ]; then
    echo "ERROR: $DEST is over the 64 MiB a device call can carry" >&2
    exit 1
fi
if [ "${1:-}" = "--with-te" ]; then
    TE=.gpu-wheels-te
    rm -rf "$TE" && mkdir -p "$TE/parts"
    $PY download -q --no-deps "${PLATFORM[@]}" -d "$TE" transformer_engine==2.10.0 transformer_engine_cu13==2.10.0
    core=$(ls "$TE"/transformer_engine_cu13-*.whl)
    split -b 60M -d "$core" "$TE/parts/$(basename "$core").part-"
    rm "$core"
    echo "Transformer Engine: $(ls "$TE/parts" | wc -l) parts of <= 60 MiB in $TE/parts; carry one per call"
    echo "(cat them back together on the device: scripts/gpu_validate.sh does when all parts are there)"
fi
