#!/usr/bin/env bash
# quire bench images on a LLaVA-shaped random checkpoint (CLIP ViT-B/16 at 224 px, a
# SmolLM2-135M-shaped decoder; make_model.py), against transformers and vLLM CPU in the
# same run, then Quire and transformers again without the torchvision shim below.
#
# vLLM 0.32 CPU cannot import its LLaVA model in the venv of quire bench install-peer
# vllm: its llava.py imports pixtral.py, which imports transformers 5.19's
# image_processing_pixtral, which imports torchvision at the top; PyPI's torchvision
# 0.28.0 is linked against CUDA torch and fails beside torch 2.13.0+cpu ("operator
# torchvision::nms does not exist"). The shim is that wheel's Python code alone: its
# compiled extensions removed and its two fake-op registrations of those missing ops
# skipped. It is put on PYTHONPATH for the whole first run, so every engine's processor
# is the torchvision-backed CLIPImageProcessor.
#
# Usage: run.sh OUT_DIR (the model goes to $MODEL, default /tmp/quire-llava-smol-224)
set -euo pipefail
out=${1:?OUT_DIR}; here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
cache=${QUIRE_CACHE_DIR:-$HOME/.cache/quire}
peers=$cache/peers
model=${MODEL:-/tmp/quire-llava-smol-224}
shim=${TV_SHIM:-/tmp/quire-torchvision-shim}
# SmolLM2's tokenizer: the hf peer's conversion of the SmolLM2 GGUF (PEERS.md), which
# `quire bench throughput --peer hf` writes
tokenizer=$(ls -d "$peers"/models/SmolLM2-135M-Instruct*-hf | head -1)

[ -f "$model/config.json" ] || python "$here/make_model.py" "$model" --tokenizer "$tokenizer"
# the hf peer's processor needs Pillow, which its install steps do not bring
"$peers/hf/bin/python" -c "import PIL" 2>/dev/null || "$peers/hf/bin/python" -m pip install pillow

if [ ! -f "$shim/torchvision/__init__.py" ]; then
  tmp=$(mktemp -d)
  python -m pip download -q --no-deps torchvision==0.28.0 -d "$tmp"
  python -m zipfile -e "$tmp"/torchvision-0.28.0-*.whl "$tmp/wheel"
  mkdir -p "$shim" && cp -r "$tmp/wheel/torchvision" "$shim/"
  rm -f "$shim"/torchvision/*.so
  python - "$shim/torchvision/_meta_registrations.py" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
text = text.replace('@torch.library.register_fake("torchvision::', '@_fake("torchvision::')
text = text.replace("def register_meta(op_name", "def _fake(name):\n"
                    "    if torchvision.extension._has_ops():\n"
                    "        return torch.library.register_fake(name)\n"
                    "    return lambda fn: fn\n\n\ndef register_meta(op_name", 1)
open(path, "w").write(text)
PY
  rm -rf "$tmp"
fi

lscpu > "$out/host-lscpu.txt"
rm -rf "$cache/dispatch"  # the cpu platform's cached dispatch timings (docs/bench.md)
PYTHONPATH=$shim quire bench images --model "$model" --device cpu --peer hf --peer vllm \
  --output "$out/images.json" > "$out/images.txt"
quire bench images --model "$model" --device cpu --peer hf \
  --output "$out/images-no-shim.json" > "$out/images-no-shim.txt"
