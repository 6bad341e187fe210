#!/usr/bin/env bash
# The headline benchmark: llama-bench decode on a ~3 GiB llama-shaped Q8_0 model at
# budgets of 25/50/75/90/125% of it, under the kernel's paging (memory cgroup) and under
# the pager, with the floor each budget allows. Writes bench/results.md (and per-budget
# compare reports under bench/). Root required (cgroups, dropping the page cache).
#   HYPEROFFLOAD_BENCH_MODEL_SIZE  size of the synthetic model (default 3G)
#   HYPEROFFLOAD_BENCH_OUT         output directory (default bench/)
# Extra arguments go to `hyperoffload bench` (e.g. --runs 1 --budgets 50,90).
set -euo pipefail
cd "$(dirname "$0")/.."

bash tools/setup.sh
small="$(bash tools/fetch-model.sh | tail -n 1)"
bin="$(bash tools/build-llama.sh | tail -n 1)"
cargo build --release --workspace

size="${HYPEROFFLOAD_BENCH_MODEL_SIZE:-3G}"
model="$(bash tools/synth-dense.sh target/release/hyperoffload "$small" "$size" | tail -n 1)"
exec target/release/hyperoffload bench --model "$model" --llama-bin "$bin" \
  --out "${HYPEROFFLOAD_BENCH_OUT:-bench}" "$@"
