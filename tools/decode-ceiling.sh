#!/usr/bin/env bash
# The fastest this machine decodes a mixture of experts with no I/O at all (issue 43):
# models that fit in RAM, read whole into the page cache first (and checked resident),
# decoded by llama-perplexity exactly as tools/bench-larger-than-ram.sh decodes, beside
# the weight bytes one token computes on (every tensor a token runs, plus the routed
# experts' used share). Their product, the weight bytes llama.cpp's matrix-vector
# products stream per second, divided into a larger model's bytes per token bounds that
# model's decode on this machine whatever reads its weights: the pager can at best
# reach it, never pass it.
#
#   bash tools/decode-ceiling.sh
#
#   SIZES   synth --size of the resident models (default "3G 12G"), each synthesized once
#           (cached) with tools/bench-larger-than-ram.sh's shape: llama, Q8_0, 128
#           experts, 8 used, the locality router
#   FF_RATIO  synth --expert-ff-ratio of the resident models (default: synth's own):
#           1.5 gives a 16G model bench-larger-than-ram.sh's width (n_embd 1728)
#   TARGET  the model whose ceiling is printed (default: bench-larger-than-ram.sh's,
#           if it was synthesized)
#   CTX     tokens decoded per run (default 128)   RUNS  runs per model (default 3)
# As root the page cache is dropped before each model is read in (room for it); nothing
# else should run meanwhile (a rate of the CPU and memory).
set -euo pipefail
cd "$(dirname "$0")/.."

bin="$(bash tools/build-llama.sh | tail -n 1)"
small="$(bash tools/fetch-model.sh | tail -n 1)"
cargo build --release --quiet --workspace
hyperoffload=target/release/hyperoffload
models=()
for size in ${SIZES:-3G 12G}; do
  models+=("$(SIZE="$size" ROUTER=qwen3 ARCH=llama TYPES=Q8_0 ORDER=file EXPERTS=128 \
    EXPERTS_USED=8 EXPERT_FF_RATIO="${FF_RATIO:-}" bash tools/synth-moe.sh "$hyperoffload" "$small" \
    | tail -n 1)")
done
mem_total_kib=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
target="${TARGET:-$(ls "${XDG_CACHE_HOME:-$HOME/.cache}"/hyperoffload/models/moe$(( mem_total_kib * 16 / 10 / 1048576 ))g-128x8-qwen3-llama-Q8_0-file-*.gguf 2>/dev/null | head -n 1 || true)}"

HO_BIN="$bin" HO_HYPEROFFLOAD="$hyperoffload" HO_TARGET="$target" HO_CTX="${CTX:-128}" \
HO_RUNS="${RUNS:-3}" HO_SIZES="${SIZES:-3G 12G}" HO_FF_RATIO="${FF_RATIO:-}" HO_COMMIT="$(git rev-parse --short HEAD)" python3 - "${models[@]}" <<'PY'
import json, os, re, statistics, subprocess, sys, time

env = os.environ
bin_dir, hyperoffload = env["HO_BIN"], env["HO_HYPEROFFLOAD"]
ctx, runs = int(env["HO_CTX"]), int(env["HO_RUNS"])
GIB = 1 << 30

def bytes_per_token(model):
    """Weight bytes one token computes on: every tensor but the routed experts, plus the
    experts' used share. The token embedding counts only where it is also the output
    head (tied, no output.weight): as an embedding a token reads one row of it."""
    info = json.loads(subprocess.run([hyperoffload, "inspect", "--json", model],
                                     check=True, capture_output=True, text=True).stdout)
    experts = info.get("experts") or {}
    total, used = experts.get("per_layer"), experts.get("used_per_token")
    if not total or not used:
        sys.exit(f"{model}: inspect names no routed experts and their use per token")
    kinds = {kind["kind"]: kind["bytes"] for kind in info["kinds"]}
    tied = "output.weight" not in kinds
    dense = sum(b for k, b in kinds.items()
                if "_exps" not in k and (tied or not k.startswith("token_embd")))
    return dense + experts["routed_bytes"] * used / total

def resident_share(model):
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES,SIZE", model],
                         check=True, capture_output=True, text=True).stdout.split()
    return int(out[0]) / max(int(out[1]), 1)

def decode_rate(model):
    if os.geteuid() == 0:
        # Room for the model: other files' pages go first.
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    with open(model, "rb") as f:
        while f.read(64 << 20):
            pass
    share = resident_share(model)
    if share < 0.99:
        sys.exit(f"{model}: only {share:.1%} resident after reading it whole: it does not fit")
    rates = []
    for _ in range(runs):
        done = subprocess.run(
            [f"{bin_dir}/llama-perplexity", "-m", model, "-f", "/usr/share/common-licenses/GPL-3",
             "-c", str(ctx), "-b", "1", "-ub", "1", "--chunks", "1", "-t", "2", "--no-repack"],
            capture_output=True, text=True)
        found = re.search(r"perplexity: ([0-9.]+) seconds per pass", done.stderr)
        if done.returncode != 0 or not found:
            sys.exit(f"{model}: llama-perplexity failed ({done.returncode}):\n{done.stderr[-2000:]}")
        rates.append(ctx / float(found.group(1)))
    return rates, share

print(f"decode-ceiling: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit "
      f"{env['HO_COMMIT']}, SIZES={env['HO_SIZES']} FF_RATIO={env['HO_FF_RATIO'] or '-'} "
      f"CTX={ctx} RUNS={runs}, llama-perplexity -b 1 -ub 1 -t 2 --no-repack, "
      "every model resident in the page cache\n")
print("| model | GiB | weight GiB/token | decode tok/s (median, range) | weight GB/s streamed |")
print("|---|---|---|---|---|")
streams = []
for model in sys.argv[1:]:
    per_token = bytes_per_token(model)
    rates, share = decode_rate(model)
    rate = statistics.median(rates)
    streams.append(rate * per_token)
    print(f"| {os.path.basename(model)} | {os.path.getsize(model) / GIB:.1f} | "
          f"{per_token / GIB:.3f} | {rate:.2f} ({min(rates):.2f}-{max(rates):.2f}) | "
          f"{rate * per_token / 1e9:.2f} |")
target = env.get("HO_TARGET")
if target:
    per_token = bytes_per_token(target)
    low, high = min(streams), max(streams)
    print(f"\n{os.path.basename(target)} ({os.path.getsize(target) / GIB:.1f} GiB): "
          f"{per_token / GIB:.3f} GiB of weights per token, so at most "
          f"{low / per_token:.2f}-{high / per_token:.2f} tok/s on this machine with every "
          "weight already in memory")
PY
