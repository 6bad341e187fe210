#!/usr/bin/env bash
# Larger than the machine, for real (issue 43): a mixture of experts of about 1.6x this
# machine's RAM, decoded by unmodified llama.cpp under the kernel (plain mmap, no cgroup,
# nothing configured) and under `hyperoffload run` with no flags, sides alternating,
# page cache dropped before every run. Beside each run a neighbour process reads its own
# file-backed mapping over and over, as a user's other programs would: its major faults
# during the run are the pages the model's paging pushed out of its working set.
#
# Prints per run and as medians: decode tok/s (llama-perplexity -b 1 -ub 1 over plain
# English, its `seconds per pass`), the time from start to exit of a one-token
# llama-completion (first token, cold), bytes read from storage (the run's wait4
# ru_inblock, io_uring workers included) and by the pager (its stats), the least
# MemAvailable sampled during the run, the neighbour's major faults, and the pager's own
# heap at its peak against the model. Root required (drop_caches).
#
#   SIZE      synth --size of the model (default 1.6x MemTotal, in GiB)
#   RUNS      runs per side (default 2)
#   CTX       tokens decoded per run (default 32)
#   TIMEOUT   seconds any one run may take before it is killed (default 1200): the
#             kernel side may decode at 0.1 tok/s or slower
#   NEIGHBOUR MiB of the neighbour's file (default 2048)
#   WRITE=1   append a section to bench/results.md (command, date, commit, table)
#   MODEL     a model to use instead of the one synthesized (once, cached) here
#   OUT       where the runs' logs, stats and the neighbour's file go
#             (default bench-out/larger-than-ram)
#   SYNTH_ONLY=1  synthesize (and time) the model, print `inspect`'s summary, and stop
set -euo pipefail
cd "$(dirname "$0")/.."

mem_total_kib=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
size="${SIZE:-$(( mem_total_kib * 16 / 10 / 1048576 ))G}"
router=qwen3
arch=llama
types=Q8_0
order=file
experts=128
experts_used=8
out="${OUT:-bench-out/larger-than-ram}"

bin="$(bash tools/build-llama.sh | tail -n 1)"
small="$(bash tools/fetch-model.sh | tail -n 1)"
cargo build --release --quiet --workspace
hyperoffload=target/release/hyperoffload

# The same cache, and keys, as tools/moe-locality-bench.sh's models.
model="${MODEL:-$(SIZE="$size" ROUTER="$router" ARCH="$arch" TYPES="$types" ORDER="$order" \
  EXPERTS="$experts" EXPERTS_USED="$experts_used" bash tools/synth-moe.sh "$hyperoffload" "$small" \
  | tail -n 1)}"
if [ "${SYNTH_ONLY:-0}" = 1 ]; then
  # Up to the predicted order: the model's size, its graph, its experts and blocks.
  # (Taken whole first: sed quitting early would end inspect with SIGPIPE, and the
  # script with it under pipefail.)
  start=$(date +%s%N)
  summary="$("$hyperoffload" inspect "$model")"
  elapsed_ms=$(( ($(date +%s%N) - start) / 1000000 ))
  sed '/^## predicted execution order/q' <<<"$summary"
  echo "inspect: $elapsed_ms ms"
  exit 0
fi

mkdir -p "$out"
export HO_BIN="$bin" HO_MODEL="$model" HO_OUT="$out" HO_HYPEROFFLOAD="$hyperoffload"
export HO_CTX="${CTX:-32}" HO_RUNS="${RUNS:-2}" HO_TIMEOUT="${TIMEOUT:-1200}"
export HO_NEIGHBOUR_MIB="${NEIGHBOUR:-2048}" HO_WRITE="${WRITE:-0}" HO_SIZE="$size"
export HO_COMMAND="${0##*/}: SIZE=$size RUNS=${RUNS:-2} CTX=${CTX:-32} TIMEOUT=${TIMEOUT:-1200} NEIGHBOUR=${NEIGHBOUR:-2048}"
exec python3 - <<'PY'
import json, os, re, signal, statistics, subprocess, sys, threading, time

MIB = 1 << 20
env = os.environ
bin_dir, model, out = env["HO_BIN"], env["HO_MODEL"], env["HO_OUT"]
hyperoffload = env["HO_HYPEROFFLOAD"]
ctx, runs, timeout = int(env["HO_CTX"]), int(env["HO_RUNS"]), float(env["HO_TIMEOUT"])
neighbour_len = int(env["HO_NEIGHBOUR_MIB"]) * MIB
model_len = os.path.getsize(model)
# Plain English every Debian machine has (base-files).
text = "/usr/share/common-licenses/GPL-3"
decode = [f"{bin_dir}/llama-perplexity", "-m", model, "-f", text, "-c", str(ctx), "-b", "1",
          "-ub", "1", "--chunks", "1", "-t", "2", "--no-repack"]
first = [f"{bin_dir}/llama-completion", "-m", model, "-p", "The capital of France is", "-n", "1",
         "-c", "256", "-t", "2", "--no-warmup", "--no-repack", "--temp", "0", "-no-cnv",
         "--no-display-prompt"]

def meminfo(field):
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None

def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")

# The neighbour: maps its file and reads a byte of every page, pass after pass, a
# second apart (a program keeping its working set in use). After its first pass it
# says so; its major faults are read from /proc/PID/stat.
NEIGHBOUR = r'''
import mmap, os, sys, time
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
first = True
while True:
    for at in range(0, len(m), 4096):
        m[at]
    if first:
        print("ready", flush=True)
        first = False
    time.sleep(1)
'''
neighbour_file = os.path.join(out, "neighbour.bin")
if not os.path.exists(neighbour_file) or os.path.getsize(neighbour_file) != neighbour_len:
    with open(neighbour_file + ".partial", "wb") as f:
        chunk = os.urandom(MIB)
        for _ in range(neighbour_len // MIB):
            f.write(chunk)
    os.rename(neighbour_file + ".partial", neighbour_file)

def majflt(pid):
    with open(f"/proc/{pid}/stat") as f:
        # Fields after the command (which may hold spaces) start at the third.
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[9])

def run(side, what, index):
    """One cold run: returns a dict of what it measured."""
    program = decode if what == "decode" else first
    name = f"{what}-{side}-{index}"
    stats = os.path.join(out, name + ".json")
    if os.path.exists(stats):
        os.remove(stats)
    args = program if side == "kernel" else [hyperoffload, "run", "--stats", stats, "--"] + program
    drop_caches()
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, neighbour_file],
                                 stdout=subprocess.PIPE, text=True)
    assert neighbour.stdout.readline().strip() == "ready"
    faults_before = majflt(neighbour.pid)
    least = [meminfo("MemAvailable")]
    done = threading.Event()
    def sample():
        while not done.wait(0.2):
            least[0] = min(least[0], meminfo("MemAvailable"))
    sampler = threading.Thread(target=sample)
    sampler.start()
    stdout_path, stderr_path = (os.path.join(out, f"{name}.{s}") for s in ("out", "err"))
    start = time.monotonic()
    with open(stdout_path, "w") as o, open(stderr_path, "w") as e:
        child = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=o, stderr=e)
        timed_out = False
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - start > timeout:
                timed_out = True
                # SIGINT first: the launcher passes it on and writes its summary.
                child.send_signal(signal.SIGINT)
                try:
                    pid, status, usage = wait4_within(child.pid, 30)
                except TimeoutError:
                    child.kill()
                    pid, status, usage = os.wait4(child.pid, 0)
                break
            time.sleep(0.05)
        child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - start
    done.set()
    sampler.join()
    faults = majflt(neighbour.pid) - faults_before
    neighbour.kill()
    neighbour.wait()
    err = open(stderr_path, errors="replace").read()
    result = {"side": side, "what": what, "run": index, "wall_s": wall, "exit": child.returncode,
              "timed_out": timed_out, "storage_read": usage.ru_inblock * 512,
              "least_available": least[0], "neighbour_majflt": faults,
              "neighbour_majflt_per_min": faults / wall * 60}
    if what == "decode":
        found = re.search(r"perplexity: ([0-9.]+) seconds per pass", err)
        result["tok_s"] = ctx / float(found.group(1)) if found else None
    if side == "pager" and os.path.exists(stats):
        j = json.load(open(stats))
        result.update(pager_read=j["bytes_read"], budget=j["budget_bytes"],
                      heap_peak=j["pager_heap_peak_bytes"],
                      peak_resident=j["peak_resident_bytes"],
                      # The graph policy saves expert counts beside the model: every
                      # pager run after the first starts from them, as a user's would.
                      warm="experts from" in j["config"].get("policy_in_use", ""))
    return result

def wait4_within(pid, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = os.wait4(pid, os.WNOHANG)
        if got[0]:
            return got
        time.sleep(0.1)
    raise TimeoutError

def mib(x):
    return "–" if x is None else f"{x / MIB:.0f}"

def describe(r):
    line = f"{r['what']:6} {r['side']:6} run {r['run']}: "
    if r["what"] == "decode":
        if r.get("tok_s"):
            line += f"{r['tok_s']:.3f} tok/s, "
        elif r["timed_out"]:
            # llama-perplexity prints nothing per token: a pass that did not finish says
            # only that fewer than CTX tokens were decoded in the time.
            line += f"timed out after {r['wall_s']:.0f} s with no pass of {ctx} tokens finished " \
                    f"(< {ctx / r['wall_s']:.3f} tok/s), "
        else:
            line += f"failed (exit {r['exit']}), "
    else:
        line += (f"first token {r['wall_s']:.2f} s, " if r["exit"] == 0 and not r["timed_out"]
                 else f"{'timed out' if r['timed_out'] else 'failed'} after {r['wall_s']:.0f} s, ")
    line += f"read {mib(r['storage_read'])} MiB from storage"
    if r["what"] == "decode":
        line += f" ({mib(r['storage_read'] / ctx)} MiB/token over the run)"
    if "pager_read" in r:
        line += (f", pager read {mib(r['pager_read'])} MiB, budget {mib(r['budget'])} MiB, "
                 f"heap peak {r['heap_peak'] / MIB:.1f} MiB"
                 + (", expert counts of an earlier run" if r["warm"] else ""))
    line += (f", least MemAvailable {mib(r['least_available'])} MiB, neighbour majflt "
             f"{r['neighbour_majflt']} ({r['neighbour_majflt_per_min']:.0f}/min), exit {r['exit']}")
    return line

print(f"# bench-larger-than-ram {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}, commit "
      + subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip())
print(f"model: {model} ({model_len / 2**30:.1f} GiB, {model_len / meminfo('MemTotal'):.2f}x MemTotal "
      f"{meminfo('MemTotal') / 2**30:.1f} GiB); {ctx} tokens per decode run; timeout {timeout:.0f} s")
print("decode: " + " ".join(decode))
print("first token: " + " ".join(first))
print("pager: hyperoffload run --stats F -- <the same>")
results = []
for index in range(1, runs + 1):
    # Alternate which side goes first, so neither always runs after the other.
    sides = ["kernel", "pager"] if index % 2 else ["pager", "kernel"]
    for what in ("decode", "first"):
        for side in sides:
            r = run(side, what, index)
            print(describe(r), flush=True)
            results.append(r)

def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None

rows = []
for side in ("kernel", "pager"):
    d = [r for r in results if r["side"] == side and r["what"] == "decode"]
    f = [r for r in results if r["side"] == side and r["what"] == "first"]
    tok = median([r.get("tok_s") for r in d])
    timeouts = sum(r["timed_out"] for r in d)
    first_s = median([r["wall_s"] for r in f if r["exit"] == 0 and not r["timed_out"]])
    per_token = median([r["storage_read"] / ctx for r in d])
    least = min(r["least_available"] for r in d + f)
    faults = median([r["neighbour_majflt_per_min"] for r in d])
    heap = max((r["heap_peak"] for r in d + f if "heap_peak" in r), default=None)
    rows.append((side, tok, timeouts, len(d), first_s, per_token, least, faults, heap))
header = ("| side | decode tok/s | first token s | read MiB/token | least MemAvailable MiB "
          "| neighbour majflt/min (decode) | pager heap peak |\n|---|---|---|---|---|---|---|")
lines = [header]
for side, tok, timeouts, n, first_s, per_token, least, faults, heap in rows:
    tok_text = f"{tok:.3f}" if tok else "–"
    if timeouts:
        tok_text += f" ({timeouts} of {n} timed out)"
    heap_text = "" if heap is None else f"{heap / MIB:.1f} MiB ({heap / model_len * 100:.3f} % of the model)"
    lines.append(f"| {side} | {tok_text} | {'–' if first_s is None else f'{first_s:.2f}'} | "
                 f"{mib(per_token)} | {mib(least)} | {'–' if faults is None else f'{faults:.0f}'} | {heap_text} |")
table = "\n".join(lines)
print()
print(table)
k, p = rows[0][1], rows[1][1]
if k and p:
    print(f"\npager/kernel decode: {p / k:.1f}x")

if env["HO_WRITE"] == "1":
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    section = [f"\n## Larger than the machine (issue 43): {date}, commit {commit}\n",
               f"`{env['HO_COMMAND']}`: model `{os.path.basename(model)}` "
               f"({model_len / 2**30:.1f} GiB, {model_len / meminfo('MemTotal'):.2f}x MemTotal), "
               f"{ctx} tokens of GPL-3 per decode run (`{' '.join(decode[3:])}`), first token from "
               f"`llama-completion -n 1 -c 256 --no-warmup`; kernel: plain mmap, no cgroup; pager: "
               f"`hyperoffload run` with no flags; page cache dropped before every run, {runs} runs "
               f"per side alternating, medians. Neighbour: a process reading a byte of every page "
               f"of its own {neighbour_len // MIB} MiB file mapping once a second; its major faults "
               f"per minute during the decode runs. Read MiB/token: the decode run's storage reads "
               f"(loading included) over its tokens.\n", table, ""]
    for r in results:
        section.append("- " + describe(r))
    with open("bench/results.md", "a") as f:
        f.write("\n".join(section) + "\n")
    print("\nwrote a section to bench/results.md")
PY
