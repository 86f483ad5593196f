#!/usr/bin/env bash
# Installs the video test oracle's virtual environment (default .venv-oracle): transformers' own video processors,
# which import torchvision, beside a CPU torch. Test-only: the product venv (.venv) has no torchvision, and
# tests/oracle/video_oracle.py runs here as a subprocess to say what transformers gives a video file.
# Repeatable: a finished install is recognised by a stamp and skipped. From the local wheels it takes about a minute
# (66 s on a shared 2-core machine), then well under a second.
#
# The PyPI torchvision wheel is a CUDA build whose C++ ops do not load against the CPU torch. The video processors
# (resize, normalize) use only its Python part on tensors (torch ops), so it is installed without its dependencies
# and its Python part is made importable without the ops (step 3, the patch of scripts/install-vllm-peer.sh step 4).
set -euo pipefail

PY=${PY:-python3.11}
VENV=${1:-.venv-oracle}
TORCH=2.13.0
TORCHVISION=0.28.0 # the release built against torch 2.13.0 (its metadata requires torch==2.13.0)
TRANSFORMERS=5.24.0
AV=18.1.0
STAMP="$VENV/.installed-oracle-torch-$TORCH-tv-$TORCHVISION-tf-$TRANSFORMERS-av-$AV"

if [ -e "$STAMP" ]; then
  echo "the video oracle is installed in $VENV"
  exit 0
fi
command -v "$PY" >/dev/null || { echo "need $PY on PATH"; exit 1; }
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q)

# 1. torch first and pinned: the CPU build of this version is on local disk; anything else pulls a CUDA build.
"${PIP[@]}" "torch==$TORCH"

# 2. transformers and the decoders its video loader uses (PyAV for files; Pillow, NumPy), then torchvision without
#    its dependencies (they would replace torch).
"${PIP[@]}" "transformers==$TRANSFORMERS" "av==$AV" pillow numpy
"${PIP[@]}" --no-deps "torchvision==$TORCHVISION"

# 3. Importing torchvision registers fake (meta) kernels for its C++ ops, which fails when the ops did not load.
#    Register them only when the ops are there; the video processors never call them.
TV=$("$VENV/bin/python" - <<'PY'
import importlib.util, os
print(os.path.dirname(importlib.util.find_spec("torchvision").origin))
PY
)
sed -i -E 's/^@torch\.library\.register_fake\(("torchvision::[a-z_]+")\)/@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda f: f))/' \
  "$TV/_meta_registrations.py"

# 4. Check: torch is still the CPU build, torchvision's Python part imports, transformers sees it and builds the
#    torchvision video processors.
"$VENV/bin/python" - <<'PY'
import torch, torchvision, transformers
from transformers.utils import is_torchvision_available
from transformers import Qwen2VLVideoProcessor, Qwen3VLVideoProcessor  # noqa: F401
assert "+cpu" in torch.__version__, torch.__version__
assert is_torchvision_available()
print(f"oracle: torch {torch.__version__} torchvision {torchvision.__version__} transformers {transformers.__version__}")
PY
touch "$STAMP"
