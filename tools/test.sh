#!/usr/bin/env bash
# The full test suite, from a fresh clone: installs what it needs, then runs every test
# against the real kernel (userfaultfd, io_uring). Idempotent; slow external builds are
# cached under ${XDG_CACHE_HOME:-$HOME/.cache}/hyperoffload.
set -euo pipefail
cd "$(dirname "$0")/.."

bash tools/setup.sh
cargo build --release --workspace --all-targets
cargo test --release --workspace
