#!/usr/bin/env bash
# Real decode of a mixture of experts whose router has real routers' locality (issue 41):
# llama-perplexity evaluates plain English one token at a time (-b 1 -ub 1, so every
# token is its own forward pass and reads only its own experts), under the kernel (a
# memory cgroup at the budget) and under `hyperoffload run` with the default policy,
# sides alternating, page cache dropped before every run and each pager run learning the
# routing from its own tokens (`hyperoffload compare` without --saved-experts).
# Prints per budget each side's tokens per second (llama.cpp's own `prompt eval time`),
# medians and every run, the ratio, bytes read per token and the cgroup peaks, with
# the command, date and commit, ready for bench/moe.md.
#
#   BUDGETS   shares of the model (default "25 50")
#   RUNS      runs per side and budget (default 3)
#   CTX       tokens decoded per run (default 128)
#   ROUTER    synth --router-locality (default qwen3; `off` for today's independent router)
#   ARCH      synth --arch (default llama; the others take no locality: ROUTER=off)
#   TYPES     synth --type (default Q8_0; Q4_K_M for llama-quantize's mix)
#   EXPERT_TYPE  synth --expert-type (default none; MXFP4 as gpt-oss is released)
#   ORDER     synth --order (default file; hf for Hugging Face conversion's)
#   SIZE      synth --size (default 3G; 128 experts of Q4_K_M need at least 3.4G)
#   EXPERTS   routed experts per layer (default 128); EXPERTS_USED per token (default 8;
#             gpt-oss-120b: 128 and 4)
#   EXPERT_FF_RATIO  synth --expert-ff-ratio (default the small model's: coarse experts;
#             0.375 gives Qwen3-30B-A3B's expert width for its embedding, 768 for 2048)
#   MODEL     a model to use instead of the one synthesized (once, cached) here
#   OUT       where compare's reports go (default bench-out/moe-locality)
set -euo pipefail
cd "$(dirname "$0")/.."

budgets="${BUDGETS:-25 50}"
runs="${RUNS:-3}"
ctx="${CTX:-128}"
router="${ROUTER:-qwen3}"
arch="${ARCH:-llama}"
types="${TYPES:-Q8_0}"
expert_type="${EXPERT_TYPE:-}"
order="${ORDER:-file}"
size="${SIZE:-3G}"
ff_ratio="${EXPERT_FF_RATIO:-}"
experts="${EXPERTS:-128}"
experts_used="${EXPERTS_USED:-8}"
out="${OUT:-bench-out/moe-locality}"

bin="$(bash tools/build-llama.sh | tail -n 1)"
small="$(bash tools/fetch-model.sh | tail -n 1)"
cargo build --release --quiet --workspace
hyperoffload=target/release/hyperoffload

model="${MODEL:-$(SIZE="$size" ROUTER="$router" ARCH="$arch" TYPES="$types" ORDER="$order" \
  EXPERTS="$experts" EXPERTS_USED="$experts_used" EXPERT_TYPE="$expert_type" \
  EXPERT_FF_RATIO="$ff_ratio" bash tools/synth-moe.sh "$hyperoffload" "$small" | tail -n 1)}"

# What the model is, as its cache key names it (tools/synth-moe.sh).
variant="$arch-$types${expert_type:+-$expert_type}-$order${ff_ratio:+-ff$ff_ratio}"

# Plain English every Debian machine has (base-files).
text=/usr/share/common-licenses/GPL-3
program=("$bin/llama-perplexity" -m "$model" -f "$text" -c "$ctx" -b 1 -ub 1 --chunks 1 -t 2 --no-repack)

echo "# moe-locality-bench $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD)"
echo "model: $model ($(stat -c %s "$model") bytes); router-locality $router; $variant; $ctx tokens per run"
echo "command: hyperoffload compare --budget B% --runs $runs -- ${program[*]}"
for budget in $budgets; do
  dir="$out/budget-${budget}pct"
  "$hyperoffload" compare --budget "$budget%" --runs "$runs" --out "$dir" -- "${program[@]}" >&2
  python3 - "$dir/report.json" "$budget" "$ctx" <<'EOF'
import json, os, re, statistics, sys
report = json.load(open(sys.argv[1]))
folder = os.path.dirname(sys.argv[1])
budget, tokens = sys.argv[2], int(sys.argv[3])
runs = report["runs"] if isinstance(report, dict) else report
def side(name):
    return [r for r in runs if r["side"].lower() == name]
def tps(r):
    # llama-perplexity times its pass over the chunk: `perplexity: 39.66 seconds per pass`.
    text = open(os.path.join(folder, r["stderr_file"]), errors="replace").read()
    found = re.search(r"perplexity: ([0-9.]+) seconds per pass", text)
    return tokens / float(found.group(1)) if found else None
def fmt(values, f="{:.2f}"):
    return ", ".join(f.format(v) for v in values)
rows = {}
for name in ("kernel", "pager"):
    rs = [r for r in side(name) if r.get("exit_code") == 0]
    speeds = [s for s in map(tps, rs) if s]
    peaks = [r["memory"]["cgroup_peak_bytes"] / 2**20 for r in rs if r["memory"].get("cgroup_peak_bytes")]
    per_token = [r["io"]["bytes_read"] / tokens / 2**20 for r in rs]
    rows[name] = (statistics.median(speeds) if speeds else None, speeds, peaks, per_token, len(side(name)) - len(rs))
k, p = rows["kernel"][0], rows["pager"][0]
print(f"\nbudget {budget} %:")
for name, (median, speeds, peaks, per_token, failed) in rows.items():
    print(f"  {name}: {median and f'{median:.2f}'} tok/s (runs {fmt(speeds)}), "
          f"read {fmt(per_token, '{:.1f}')} MiB/token, cgroup peak {fmt(peaks, '{:.0f}')} MiB"
          + (f", {failed} failed runs" if failed else ""))
if k and p:
    print(f"  pager/kernel: {p / k:.1f}x")
EOF
done
