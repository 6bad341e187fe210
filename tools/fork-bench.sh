#!/usr/bin/env bash
# The figures of preload/README.md "Serving forked children": a Python reader of a
# 128 MiB .gguf of random bytes under --budget 32M, in the parent, in one forked child,
# and in two forked children reading in step (4 MiB pieces, a barrier after each): with
# --serve-forks=never (children map the page cache), by default (zero copy until the
# fork makes the regions inheritable), and with --serve-forks from the start (its blocks
# read in place, and copied in). Prints each run's reader line (digest, seconds, its
# Rss{Anon,File,Shmem} in kB) and the pager's stats that matter.
#
# Usage: tools/fork-bench.sh [DIR]   (DIR defaults to a new directory under /tmp)
# Needs the release build of the workspace (cargo build --release --workspace).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${1:-$(mktemp -d /tmp/fork-bench.XXXXXX)}
mkdir -p "$dir"
launcher=$here/target/release/hyperoffload
export HYPEROFFLOAD_SHIM=$here/target/release/libhyperoffload_preload.so
python=$(python3 -c 'import sys; print(sys.executable)')
model=$dir/m.gguf
[ -f "$model" ] || head -c $((128 << 20)) /dev/urandom > "$model"
cat > "$dir/reader.py" <<'PY'
import sys, os, mmap, hashlib, time, multiprocessing as mp
mode, path = sys.argv[1], sys.argv[2]
f = open(path, "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
PIECE = 4 << 20
def rss():
    return {k: int(v.split()[0]) for k, v in (l.split(":") for l in open("/proc/self/status"))
            if k in ("RssAnon", "RssFile", "RssShmem")}
def read_all(barrier=None):
    t, h = time.time(), hashlib.sha256()
    for s in range(0, len(m), PIECE):
        h.update(m[s:s + PIECE])
        if barrier: barrier.wait()
    return h.hexdigest()[:16], "%.2fs" % (time.time() - t), rss()
if mode == "parent":
    print("parent", *read_all(), flush=True)
elif mode == "child":
    pid = os.fork()
    if pid == 0:
        print("child", *read_all(), flush=True); os._exit(0)
    os.waitpid(pid, 0)
elif mode == "two":
    ctx = mp.get_context("fork"); barrier = ctx.Barrier(2); out = ctx.Queue()
    procs = [ctx.Process(target=lambda: out.put(read_all(barrier))) for _ in range(2)]
    for p in procs: p.start()
    results = [out.get() for _ in procs]
    for p in procs: p.join()
    print("two", *results, flush=True)
PY
for flags in "--serve-forks=never" "" "--no-zero-copy --block 2M" "--serve-forks" "--serve-forks --no-zero-copy --block 2M"; do
  for mode in parent child two; do
    rm -f "$dir/stats.json" "$model".hyperoffload-*
    echo "== [${flags:-default}] $mode"
    "$launcher" run $flags --budget 32M --min-size 1M --quiet --stats "$dir/stats.json" \
      -- "$python" "$dir/reader.py" "$mode" "$model" 2>&1 | grep -v '^hyperoffload: learned'
    python3 - "$dir/stats.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
keys = ["bytes_read", "block_size", "faults", "child_faults", "forked_children", "peak_resident_bytes"]
print({k: j.get(k) for k in keys}, "fault p50 us", j["fault_latency_us"]["p50"])
PY
  done
done
