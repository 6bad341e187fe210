#!/usr/bin/env bash
# Installs the system packages the build and tests need. Idempotent: packages already
# present are not touched, and apt is only consulted when something is missing.
set -euo pipefail

# libclang-dev: the userfaultfd crate runs bindgen at build time.
# cmake: builds llama.cpp (tools/build-llama.sh), and aws-lc-sys (object_store's TLS).
# fuse3: fusermount3, for `hyperoffload mount` without root (as root it mounts itself).
# nginx-light: the HTTP server of the mount tests (tools/nginx.sh; its service is not
# started: policy-rc.d or no init may refuse, and the tests run their own).
want=(libclang-dev cmake fuse3 nginx-light)
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

# Python clients of the shim tests (tests/shim_python.rs): numpy and safetensors, in
# the user's python3 if it takes pip installs, else (a distribution's Python refuses
# them: PEP 668, "externally managed") in a virtual environment of our own, which the
# tests use when it exists.
venv="${XDG_CACHE_HOME:-$HOME/.cache}/hyperoffload/python"
if ! command -v python3 >/dev/null 2>&1; then
  echo "setup: python3 not found: tests/shim_python.rs needs python3 with numpy and safetensors" >&2
  exit 1
fi
has_clients() { "$1" -c "import numpy, safetensors" >/dev/null 2>&1; }
if ! has_clients python3 && ! { [ -x "$venv/bin/python3" ] && has_clients "$venv/bin/python3"; }; then
  echo "setup: installing numpy and safetensors (pip)" >&2
  if ! python3 -m pip install --quiet numpy safetensors 2>"${TMPDIR:-/tmp}/hyperoffload-pip.$$"; then
    if ! grep -q "externally-managed-environment" "${TMPDIR:-/tmp}/hyperoffload-pip.$$"; then
      cat "${TMPDIR:-/tmp}/hyperoffload-pip.$$" >&2
      rm -f "${TMPDIR:-/tmp}/hyperoffload-pip.$$"
      exit 1
    fi
    echo "setup: this python3 is externally managed; using a virtual environment in $venv" >&2
    if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c "import ensurepip" >/dev/null 2>&1; then
      if [ "$(id -u)" -ne 0 ]; then
        echo "setup: need root to install python3-venv" >&2
        exit 1
      fi
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
    fi
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python3" -m pip install --quiet numpy safetensors
  fi
  rm -f "${TMPDIR:-/tmp}/hyperoffload-pip.$$"
fi
