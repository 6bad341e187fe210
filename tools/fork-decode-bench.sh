#!/usr/bin/env bash
# Two forked llama.cpp decoders of one model against one (bench/fork.md): a synthetic
# 3 GiB Q8_0 model shaped like SmolLM2, tests/victims/fork_decode.c (loads it with mmap,
# forks, each child greedily decodes TOKENS tokens, 1 thread each, in step by STEP),
# under `hyperoffload run --serve-forks=FORKS --budget 50%` and under the kernel (the file's
# page cache dropped first), each run in a memory cgroup of its own whose peak usage is
# reported (v1 memory.max_usage_in_bytes, or v2 memory.peak). The kernel runs once
# without a limit and once limited to the pager's budget plus what the pager run used
# beyond it (the program's own memory), so both have the same memory.
#
# Prints, per run: the children's lines (tok/s, their storage reads, RssFile, RssShmem)
# and one summary line: bytes read (the pager's, or under the kernel the parent's
# read_bytes, which include its reaped children's), cgroup peak.
#
# Usage: tools/fork-decode-bench.sh [DIR] (default /tmp/fork-decode-bench)
# Environment: TOKENS (8), STEP (layer and token), SIZE (3G), FORKS (at-fork, the
# default: zero copy until the fork; or always), RUNS (pager and kernel;
# the kernel runs' cgroup limit is the peak of an earlier pager run in DIR).
# Needs root (cgroups), the release build of the workspace, llama.cpp (tools/build-llama.sh)
# and the SmolLM2 model (tools/fetch-model.sh).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${1:-/tmp/fork-decode-bench}
tokens=${TOKENS:-8}
steps=${STEP:-layer token}
size=${SIZE:-3G}
forks=${FORKS:-at-fork}
mkdir -p "$dir"
launcher=$here/target/release/hyperoffload
export HYPEROFFLOAD_SHIM=$here/target/release/libhyperoffload_preload.so
decoder=$("$here/tools/build-fork-decode.sh" "$dir/bin" | tail -n 1)
like=$("$here/tools/fetch-model.sh" | tail -n 1)
model=$dir/synth-$size.gguf
[ -f "$model" ] || "$launcher" synth --like "$like" --size "$size" --type Q8_0 --out "$model" >&2
prompt="The capital of France is"

if [ -d /sys/fs/cgroup/memory ]; then
  cg_root=/sys/fs/cgroup/memory; limit_file=memory.limit_in_bytes; peak_file=memory.max_usage_in_bytes
else
  cg_root=/sys/fs/cgroup; limit_file=memory.max; peak_file=memory.peak
fi
cg=$cg_root/hyperoffload-fork-decode-$$
cleanup() { [ -d "$cg" ] && rmdir "$cg" 2>/dev/null || true; }
trap cleanup EXIT

# The model's pages out of the page cache (written back first: dirty pages stay),
# checked: what is still cached is said.
drop_cache() {
  sync "$model"
  python3 -c 'import os,sys; fd=os.open(sys.argv[1], os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)' "$model"
  if command -v fincore > /dev/null; then
    echo "page cache of the model before the run: $(fincore -n -o RES "$model")"
  fi
}

# run NAME LIMIT CMD...: CMD in a new cgroup (LIMIT bytes, or "" for none); prints
# the children's lines, then "NAME: ... peak P".
run() {
  local name=$1 limit=$2; shift 2
  mkdir "$cg"
  [ -n "$limit" ] && echo "$limit" > "$cg/$limit_file"
  local out=$dir/$name.out
  sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' sh "$cg" "$@" > "$out" 2>&1 || {
    cat "$out"; echo "$name failed" >&2; exit 1; }
  local peak; peak=$(cat "$cg/$peak_file")
  rmdir "$cg"
  grep -E '^(child [0-9]+: [0-9]+ tokens|parent: )' "$out" || true
  # The children's texts, each once with how many printed it.
  grep -E '^child [0-9]+: ' "$out" | grep -v ' tokens in ' | sed 's/^child [0-9]*: //' \
    | sort | uniq -c | sed 's/^ */  text x/'
  local read
  if [ -f "$dir/$name.json" ]; then
    read=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["bytes_read"])' "$dir/$name.json")
  else
    # The parent's count includes its children's once it has reaped them.
    read=$(grep -E '^parent: ' "$out" | grep -oE 'read_bytes [0-9]+' | awk '{print $2}')
  fi
  awk -v n="$name" -v r="$read" -v p="$peak" 'BEGIN {
    printf "%s: bytes read %.0f (%.2f GiB), cgroup peak %.0f (%.2f GiB)\n", n, r, r / 2^30, p, p / 2^30 }'
  echo "$peak" > "$dir/$name.peak"
}

runs=${RUNS:-pager kernel}
for step in $steps; do
  [[ " $runs " == *" pager "* ]] || break
  for procs in 1 2; do
    name=pager-$step-$procs
    rm -f "$dir/$name.json" "$model".hyperoffload-*
    echo "== $name: hyperoffload run --serve-forks=$forks --budget 50% -- fork_decode MODEL $tokens $procs 1 $step"
    run "$name" "" "$launcher" run --serve-forks="$forks" --budget 50% --stats "$dir/$name.json" \
      -- "$decoder" "$model" "$tokens" "$procs" 1 "$step" "$prompt"
  done
done
step=${steps%% *}
budget=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["budget_bytes"])' "$dir/pager-$step-2.json")
pager_peak=$(cat "$dir/pager-$step-2.peak")
[[ " $runs " == *" kernel "* ]] || exit 0
for limit in "" "$pager_peak"; do
  for procs in 1 2; do
    name=kernel-$step-$procs${limit:+-limited}
    drop_cache
    echo "== $name: fork_decode MODEL $tokens $procs 1 $step${limit:+ (cgroup limit $limit bytes: the peak of the pager run, budget $budget)}"
    run "$name" "$limit" "$decoder" "$model" "$tokens" "$procs" 1 "$step" "$prompt"
  done
done
