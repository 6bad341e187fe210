#!/usr/bin/env bash
# Decode speed with the default `--budget auto` against a fixed budget, without memory
# pressure: llama-bench tg under `hyperoffload run`, the two alternating in pairs (so a
# loaded machine slows both alike), then each side's median and range of tok/s.
#   MODEL  the GGUF file (required)        FIXED  the fixed budget (100%: the model fits)
#   PAIRS  pairs of runs (4)               TOKENS tokens decoded per run (16)
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL:?MODEL=path/to/model.gguf}"
FIXED=${FIXED:-100%} PAIRS=${PAIRS:-4} TOKENS=${TOKENS:-16}
BENCH=${BENCH:-${XDG_CACHE_HOME:-$HOME/.cache}/hyperoffload/llama.cpp-11434.0.0/bin/llama-bench}
cargo build --release --workspace >&2
out=$(mktemp -d)
one() { # budget label
    ./target/release/hyperoffload run --budget "$1" --stats "$out/$2.json" -- \
        "$BENCH" -m "$MODEL" -p 0 -n "$TOKENS" -t 2 -r 1 --repack 0 -o csv 2>"$out/$2.err" |
        tail -1 | awk -F, '{gsub(/"/, "", $(NF-1)); print $(NF-1)}' >>"$out/$3.tok"
}
for i in $(seq "$PAIRS"); do
    one auto "auto-$i" auto
    one "$FIXED" "fixed-$i" fixed
done
python3 - "$out" "$FIXED" <<'PY'
import json, statistics, sys
out, fixed = sys.argv[1], sys.argv[2]
def side(name):
    return [float(line) for line in open(f"{out}/{name}.tok") if line.strip()]
auto, fix = side("auto"), side("fixed")
budget = json.load(open(f"{out}/auto-1.json"))["budget_bytes"] / 2**20
for name, values in (("auto", auto), (f"fixed {fixed}", fix)):
    print(f"{name:>12}: median {statistics.median(values):.2f} tok/s, "
          f"range {min(values):.2f}-{max(values):.2f}, runs {len(values)}")
print(f"auto / fixed (medians): {statistics.median(auto) / statistics.median(fix):.3f}; "
      f"auto's budget {budget:.0f} MiB")
PY
