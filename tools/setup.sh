#!/usr/bin/env bash
# Installs the system packages the build and tests need. Idempotent: packages already
# present are not touched, and apt is only consulted when something is missing.
set -euo pipefail

# libclang-dev: the userfaultfd crate runs bindgen at build time.
# cmake: builds llama.cpp (tools/build-llama.sh).
# python3-venv is not needed: pip installs into the user's Python.
want=(libclang-dev cmake)
missing=()
for pkg in "${want[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: need root to install ${missing[*]} (run as root or install them yourself)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found: install a Rust toolchain (rustup) first" >&2
  exit 1
fi

# Python clients of the shim tests (tests/shim_python.rs): numpy and safetensors.
if command -v python3 >/dev/null 2>&1; then
  if ! python3 -c "import numpy, safetensors" >/dev/null 2>&1; then
    echo "setup: installing numpy and safetensors (pip)" >&2
    python3 -m pip install --quiet numpy safetensors
  fi
else
  echo "setup: python3 not found: tests/shim_python.rs needs python3 with numpy and safetensors" >&2
  exit 1
fi
