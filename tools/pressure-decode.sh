#!/usr/bin/env bash
# Decode speed through memory pressure: llama-completion generating under
# `hyperoffload run` in a memory cgroup, and beside it a hog that takes a share of the
# cgroup in steps, holds it, and exits. The tokens' arrival times (each write of the
# program's output, read as it comes) give the decode rate in 1 s windows: before the
# hog, beside it, and how long after it exited the rate was back within 10 % of a
# reference run's at the same tokens (the same decode with a hog of nothing, run first:
# the program slows by itself as its context fills). Root required (cgroups).
#   LIMIT   the cgroup's limit in MiB (default 1536)   SIZE  the synthesized model (1G)
#   HOG     the hog's share of the limit, % (60)        HOLD  seconds the hog holds it (10)
#   BEFORE  seconds of decode before the hog (15)      AFTER seconds after it exits (25)
#   BUDGET  --budget (auto)                            MODEL a GGUF instead of synthesizing
# The context is 512 tokens, so that the KV cache (the program's own memory) stays small.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --workspace >&2
bin="$(bash tools/build-llama.sh | tail -n 1)"
small="$(bash tools/fetch-model.sh | tail -n 1)"
exec python3 - "$bin" "$small" <<'PY'
import os, sys, time, signal, subprocess, shutil, tempfile, threading, json, statistics

MIB = 1 << 20
bin_dir, small = sys.argv[1], sys.argv[2]
limit = int(os.environ.get("LIMIT", "1536")) * MIB
hog = limit * int(os.environ.get("HOG", "60")) // 100
hold = float(os.environ.get("HOLD", "10"))
before_s = float(os.environ.get("BEFORE", "15"))
after_s = float(os.environ.get("AFTER", "25"))
budget = os.environ.get("BUDGET", "auto")
launcher = "target/release/hyperoffload"

v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
root = "/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/memory"
cg = os.path.join(root, f"hyperoffload-pressure-decode-{os.getpid()}")
os.mkdir(cg)
def cgfile(name): return os.path.join(cg, name)
with open(cgfile("memory.max" if v2 else "memory.limit_in_bytes"), "w") as f: f.write(str(limit))
def oom_kills():
    with open(cgfile("memory.events" if v2 else "memory.oom_control")) as f:
        return next(int(l.split()[1]) for l in f if l.startswith("oom_kill "))
def enter():
    with open(cgfile("cgroup.procs"), "w") as f: f.write("0")

tmp = tempfile.mkdtemp(prefix="pressure-decode-")
model = os.environ.get("MODEL")
if not model:
    model = os.path.join(tmp, "model.gguf")
    subprocess.run([launcher, "synth", "--like", small, "--size", os.environ.get("SIZE", "1G"),
                    "--type", "Q8_0", "--out", model], check=True, stdout=subprocess.DEVNULL)

HOG_SCRIPT = r"""
import sys, time
total, hold = int(sys.argv[1]), float(sys.argv[2])
held, step = [], 32 << 20
while sum(map(len, held)) < total:
    b = bytearray(step); b[::4096] = b"\x01" * len(range(0, step, 4096)); held.append(b)
    time.sleep(0.1)
time.sleep(hold)
"""

def scenario(hog_bytes, stats):
    """One decode with a hog of `hog_bytes` beside it (0: the reference, same timing)."""
    args = [launcher, "run", "--quiet", "--stats", stats]
    if budget != "auto": args += ["--budget", budget]
    args += ["--", os.path.join(bin_dir, "llama-completion"), "-m", model, "-p", "Once upon a time",
             "-n", "100000", "--ignore-eos", "--temp", "0", "--seed", "1", "-t", "2", "-no-cnv",
             "--no-display-prompt", "--no-repack", "-c", "512"]
    launched = time.monotonic()
    program = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               stdin=subprocess.DEVNULL, preexec_fn=enter)
    arrivals = []  # the time of each write of generated text: a token each
    def read_tokens():
        fd = program.stdout.fileno()
        while os.read(fd, 1 << 16):
            arrivals.append(time.monotonic())
    reader = threading.Thread(target=read_tokens, daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while not arrivals and program.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not arrivals:
        sys.exit(f"no token within 300 s (exit {program.poll()})")
    t0 = arrivals[0]
    time.sleep(before_s)
    hog_start = time.monotonic()
    hog_proc = subprocess.Popen(["python3", "-c", HOG_SCRIPT, str(hog_bytes), str(hold)],
                                preexec_fn=enter)
    hog_proc.wait()
    hog_end = time.monotonic()
    time.sleep(after_s)
    program.send_signal(signal.SIGINT)
    try:
        program.wait(timeout=30)
    except subprocess.TimeoutExpired:
        program.kill(); program.wait()
    reader.join(timeout=5)
    return dict(arrivals=arrivals, launched=launched, t0=t0, hog_start=hog_start,
                hog_end=hog_end, exit=program.returncode, hog_exit=hog_proc.returncode)

# The program's own rate falls as its context fills (attention over more tokens), so the
# rate after the hog is compared with a reference run without one at the same tokens:
# the reference decodes token i in the time the unpressured program takes for it.
ref = scenario(0, os.path.join(tmp, "reference.json"))
stats = os.path.join(tmp, "stats.json")
run = scenario(hog, stats)
arrivals, t0, hog_start, hog_end = run["arrivals"], run["t0"], run["hog_start"], run["hog_end"]

def rate(start, end, times=arrivals):
    n = sum(1 for t in times if start <= t < end)
    return n / (end - start) if end > start else 0.0
def reference_rate(start, end):
    """The reference's rate over the tokens the run wrote in [start, end)."""
    idx = [i for i, t in enumerate(arrivals) if start <= t < end]
    r = ref["arrivals"]
    if len(idx) < 2 or idx[-1] >= len(r):
        return None
    return (idx[-1] - idx[0]) / (r[idx[-1]] - r[idx[0]]) if r[idx[-1]] > r[idx[0]] else None
# Steady rate before the hog: 1 s windows from the 3rd second (past the first pass).
windows = [rate(t0 + s, t0 + s + 1) for s in range(2, int(hog_start - t0) - 1)]
unpressured = statistics.median(windows) if windows else 0.0
beside = rate(hog_start, hog_end)
back = None
t = hog_end
while t + 2 <= hog_end + after_s:
    reference = reference_rate(t, t + 2)
    if reference and rate(t, t + 2) >= 0.9 * reference:
        back = t - hog_end
        break
    t += 0.25
after_rate = rate(hog_end + after_s - 10, hog_end + after_s)
print(f"cgroup v{2 if v2 else 1} limit {limit // MIB} MiB, model {os.path.getsize(model) // MIB} MiB, "
      f"hog {hog // MIB} MiB held {hold:.0f} s, --budget {budget}")
print(f"decode before the hog: {unpressured:.2f} tok/s (median of {len(windows)} 1 s windows, "
      f"range {min(windows, default=0):.2f}-{max(windows, default=0):.2f})")
print(f"beside the hog ({hog_end - hog_start:.1f} s): {beside:.2f} tok/s")
print("back within 10 %% of the reference at the same tokens (a 2 s window): %s" % (
      f"{back:.2f} s after the hog exited" if back is not None else f"not within {after_s:.0f} s"))
print(f"the last 10 s: {after_rate:.2f} tok/s")
print("1 s windows from the hog's exit, tok/s (the reference at the same tokens):",
      " ".join(f"{rate(hog_end + s, hog_end + s + 1):.0f} ({reference_rate(hog_end + s, hog_end + s + 1) or 0:.0f})"
               for s in range(int(after_s))))
print(f"program exit {run['exit']}, hog exit {run['hog_exit']}, OOM kills {oom_kills()}")
try:
    pager = json.load(open(stats))
    history = pager["budget_history"]
    print("pager: %d faults, %d on demand, %.0f MiB read, %d evictions" % (
          pager["faults"], pager["demand_faults"], pager["bytes_read"] / MIB, pager["evictions"]))
    print("budget history (s from the start, MiB):",
          " ".join(f"{p['t_s']:.1f}:{p['bytes'] // MIB}" for p in history))
    print(f"first token at {t0 - run['launched']:.1f} s; the hog ran from "
          f"{hog_start - run['launched']:.1f} s to {hog_end - run['launched']:.1f} s")
except (OSError, ValueError, KeyError):
    print("no stats (the program was killed?)")
shutil.rmtree(tmp)
for _ in range(50):
    try: os.rmdir(cg); break
    except OSError: time.sleep(0.1)
PY
