#!/usr/bin/env bash
# A model split in several files against the same model in one (bench/results.md, "A
# split model"): the headline's 3 GiB llama copied whole and split in four by
# llama-gguf-split (--split-max-size 1G), both copies written just before the runs (the
# virtual disk's host cache favours recently written files, so neither side reads older
# bytes), llama-bench decode under `hyperoffload run --budget B`, sides alternating,
# page cache dropped before every run. Prints each run's tok/s and the pager's bytes
# read, the medians, the command, the date and the commit, ready for bench/results.md.
# Root required (dropping the page cache).
#
#   RUNS    alternating pairs of runs (default 3)
#   BUDGET  the pager's budget (default 90%: of all the parts for the split copy)
#   TOKENS  llama-bench -n (default 32)
#   DIR     where the two copies go (default a new directory under /var/tmp, removed
#           after)
set -euo pipefail
cd "$(dirname "$0")/.."

runs="${RUNS:-3}"
budget="${BUDGET:-90%}"
tokens="${TOKENS:-32}"

bin="$(bash tools/build-llama.sh | tail -n 1)"
small="$(bash tools/fetch-model.sh | tail -n 1)"
cargo build --release --quiet --workspace
hyperoffload="$PWD/target/release/hyperoffload"

model="$(bash tools/synth-dense.sh "$hyperoffload" "$small" | tail -n 1)"

if [ -n "${DIR:-}" ]; then
  dir="$DIR"
  mkdir -p "$dir"
else
  dir="$(mktemp -d /var/tmp/hyperoffload-split-bench.XXXXXX)"
  trap 'rm -rf "$dir"' EXIT
fi
rm -f "$dir"/one.gguf "$dir"/parts-*.gguf
cp "$model" "$dir/one.gguf"
"$bin/llama-gguf-split" --split --split-max-size 1G "$dir/one.gguf" "$dir/parts" >/dev/null
first="$(ls "$dir"/parts-00001-of-*.gguf)"
echo "# split-bench $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD)"
echo "model: $model ($(stat -c %s "$model") bytes), split in $(ls "$dir"/parts-*.gguf | wc -l) files"
echo "command: hyperoffload run --budget $budget --stats S -- llama-bench -m M -p 0 -n $tokens -t 2 -r 1 --repack 0 -o json"

for run in $(seq 1 "$runs"); do
  for side in parts one; do
    case "$side" in
      parts) file="$first" ;;
      one) file="$dir/one.gguf" ;;
    esac
    stats="$dir/stats-$side-$run.json"
    rm -f "$stats"
    sync
    echo 3 >/proc/sys/vm/drop_caches
    "$hyperoffload" run --budget "$budget" --stats "$stats" -- \
      "$bin/llama-bench" -m "$file" -p 0 -n "$tokens" -t 2 -r 1 --repack 0 -o json \
      >"$dir/bench-$side-$run.json" 2>"$dir/bench-$side-$run.err"
    python3 - "$side" "$run" "$stats" "$dir/bench-$side-$run.json" <<'EOF'
import json, sys
side, run, stats, bench = sys.argv[1:]
read = json.load(open(stats))["bytes_read"]
tps = json.load(open(bench))[0]["avg_ts"]
print(f"run {run} {side}: {tps:.2f} tok/s, pager read {read / 1e9:.2f} GB")
EOF
  done
done | tee "$dir/runs.txt"

python3 - "$dir/runs.txt" <<'EOF'
import re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"run \d+ (\w+): ([0-9.]+) tok/s, pager read ([0-9.]+) GB", line)
    if m:
        rows.setdefault(m.group(1), []).append((float(m.group(2)), float(m.group(3))))
print()
print("| model | bytes read per run | tok/s, range (median) |")
print("|---|---|---|")
for side, label in [("parts", "split files"), ("one", "one file")]:
    tps = [t for t, _ in rows[side]]
    gb = [g for _, g in rows[side]]
    print(f"| {label} | {min(gb):.2f}-{max(gb):.2f} GB | {min(tps):.2f}-{max(tps):.2f} ({statistics.median(tps):.2f}) |")
EOF
