#!/usr/bin/env bash
# The full test suite, from a fresh clone: installs what it needs, then runs every test
# against the real kernel (userfaultfd, io_uring). Idempotent; slow external builds are
# cached under ${XDG_CACHE_HOME:-$HOME/.cache}/hyperoffload.
set -euo pipefail
cd "$(dirname "$0")/.."

bash tools/setup.sh
# llama.cpp and the SmolLM2 model for tests/shim_llama.rs (cached; fast when present).
# Until those scripts are merged, the test finds a cached build and model by itself.
for script in build-llama.sh fetch-model.sh; do
  if [ -f "tools/$script" ]; then
    bash "tools/$script" >/dev/null
  fi
done
# --workspace also builds the shim (preload/) beside the hyperoffload binary.
cargo build --release --workspace --all-targets
cargo test --release --workspace
