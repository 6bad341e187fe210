#!/usr/bin/env bash
# The bytes each eviction policy reads on a real llama.cpp decode of a mixture of experts
# (issue 42's "at most 1.5x Belady, never more than LRU"): records a demand trace of
# llama-perplexity evaluating plain English one token at a time (every block the program
# touches, in order: `hyperoffload run --policy demand` with a 16 MiB budget), then
# replays it against the graph the pager builds from the model with each policy at each
# budget. Prints MiB read per token after the first (the steady state) as a markdown
# table with the command, date and commit, ready for bench/moe.md.
#
#   bash tools/moe-trace-replay.sh MODEL.gguf...   (as tools/moe-locality-bench.sh makes
#                                                    them: tools/synth-moe.sh)
#
#   CTX       tokens per trace (default 512: a topic shift or two; 128 is mostly first uses)
#   BUDGETS   shares of the model (default "25 50 75")
#   OUT       where the traces go, kept and reused per model and CTX
#             (default bench-out/traces); RERECORD=1 records them again
#
# A trace depends on the model and llama.cpp, not on the pager's policy: it is recorded
# once and replayed by whatever policy the tree has.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 MODEL.gguf..." >&2; exit 2; }

ctx="${CTX:-512}"
budgets="${BUDGETS:-25 50 75}"
out="${OUT:-bench-out/traces}"
policies=(graph "lru --prefetch none" frequency lfu belady)

bin="$(bash tools/build-llama.sh | tail -n 1)"
cargo build --release --quiet --workspace
hyperoffload=target/release/hyperoffload
mkdir -p "$out"

text=/usr/share/common-licenses/GPL-3
echo "# moe-trace-replay $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD)"
echo "trace: hyperoffload run --policy demand --block 2M --budget 16M --trace T -- llama-perplexity -m M -f $text -c $ctx -b 1 -ub 1 --chunks 1 -t 2 --no-repack"
echo "replay: hyperoffload simulate --trace T --model M --budget B% --policy P --json (steady_bytes_per_token)"
echo
echo "| model | budget | graph | LRU | frequency (offline) | online LFU | Belady | graph / LRU | graph / Belady |"
echo "|---|---|---|---|---|---|---|---|---|"
for model in "$@"; do
  [ -f "$model" ] || { echo "no model at $model" >&2; exit 1; }
  trace="$out/$(basename "$model" .gguf)-c$ctx.csv"
  if [ ! -s "$trace" ] || [ "${RERECORD:-0}" = 1 ]; then
    # No cache drop: the trace is the order the program touches blocks in, which the
    # page cache does not change (the pager reads with O_DIRECT).
    rm -f "$trace" "$trace.events.jsonl"
    echo "moe-trace-replay: recording $trace" >&2
    "$hyperoffload" run --policy demand --block 2M --budget 16M --trace "$trace" -- \
      "$bin/llama-perplexity" -m "$model" -f "$text" -c "$ctx" -b 1 -ub 1 --chunks 1 -t 2 \
      --no-repack >"$trace.log" 2>&1 || { tail -n 20 "$trace.log" >&2; exit 1; }
  fi
  for budget in $budgets; do
    row=()
    for policy in "${policies[@]}"; do
      # shellcheck disable=SC2086 # the policy carries its own flags
      mib=$("$hyperoffload" simulate --trace "$trace" --model "$model" --budget "$budget%" \
        --policy $policy --json |
        python3 -c "import json,sys; print(json.load(sys.stdin)['steady_bytes_per_token'] / 2**20)")
      row+=("$mib")
    done
    python3 - "$(basename "$model")" "$budget" "${row[@]}" <<'EOF'
import sys
name, budget, *values = sys.argv[1:]
graph, lru, frequency, lfu, belady = map(float, values)
cells = " | ".join(f"{v:.2f}" for v in (graph, lru, frequency, lfu, belady))
print(f"| {name} | {budget} % | {cells} | {graph / lru:.3f}x | {graph / belady:.2f}x |")
EOF
  done
done
