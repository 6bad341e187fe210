#!/usr/bin/env bash
# Decode speed through memory pressure: llama-completion generating under
# `hyperoffload run` in a memory cgroup, and beside it a hog that takes a share of the
# cgroup in steps, holds it, and exits. The tokens' arrival times (each write of the
# program's output, read as it comes) give the decode rate in 1 s windows: before the
# hog, beside it, and how long after it exited the rate was back within 10 % of the
# rate before. Root required (cgroups).
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
stats = os.path.join(tmp, "stats.json")
model = os.environ.get("MODEL")
if not model:
    model = os.path.join(tmp, "model.gguf")
    subprocess.run([launcher, "synth", "--like", small, "--size", os.environ.get("SIZE", "1G"),
                    "--type", "Q8_0", "--out", model], check=True, stdout=subprocess.DEVNULL)

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
hog_script = r'''
import sys, time
total, hold = int(sys.argv[1]), float(sys.argv[2])
held, step = [], 32 << 20
while sum(map(len, held)) < total:
    b = bytearray(step); b[::4096] = b"\x01" * len(range(0, step, 4096)); held.append(b)
    time.sleep(0.1)
time.sleep(hold)
'''
hog_start = time.monotonic()
hog_proc = subprocess.Popen(["python3", "-c", hog_script, str(hog), str(hold)], preexec_fn=enter)
hog_proc.wait()
hog_end = time.monotonic()
time.sleep(after_s)
program.send_signal(signal.SIGINT)
try:
    program.wait(timeout=30)
except subprocess.TimeoutExpired:
    program.kill(); program.wait()
reader.join(timeout=5)

def rate(start, end):
    n = sum(1 for t in arrivals if start <= t < end)
    return n / (end - start) if end > start else 0.0
# Steady rate before the hog: 1 s windows from the 3rd second (past the first pass).
windows = [rate(t0 + s, t0 + s + 1) for s in range(2, int(hog_start - t0) - 1)]
unpressured = statistics.median(windows) if windows else 0.0
beside = rate(hog_start, hog_end)
back = None
t = hog_end
while t + 2 <= hog_end + after_s:
    if unpressured and rate(t, t + 2) >= 0.9 * unpressured:
        back = t - hog_end
        break
    t += 0.25
after_rate = rate(hog_end + after_s - 10, hog_end + after_s)
print(f"cgroup v{2 if v2 else 1} limit {limit // MIB} MiB, model {os.path.getsize(model) // MIB} MiB, "
      f"hog {hog // MIB} MiB held {hold:.0f} s, --budget {budget}")
print(f"decode before the hog: {unpressured:.2f} tok/s (median of {len(windows)} 1 s windows, "
      f"range {min(windows, default=0):.2f}-{max(windows, default=0):.2f})")
print(f"beside the hog ({hog_end - hog_start:.1f} s): {beside:.2f} tok/s")
print("back within 10 %% (a 2 s window at >= %.2f tok/s): %s" % (0.9 * unpressured,
      f"{back:.2f} s after the hog exited" if back is not None else f"not within {after_s:.0f} s"))
print(f"the last 10 s: {after_rate:.2f} tok/s")
print(f"program exit {program.returncode}, hog exit {hog_proc.returncode}, OOM kills {oom_kills()}")
try:
    history = json.load(open(stats))["budget_history"]
    print("budget history (s from the start, MiB):",
          " ".join(f"{p['t_s']:.1f}:{p['bytes'] // MIB}" for p in history))
    print(f"first token at {t0 - launched:.1f} s; the hog ran from {hog_start - launched:.1f} s "
          f"to {hog_end - launched:.1f} s")
except (OSError, ValueError, KeyError):
    print("no stats (the program was killed?)")
shutil.rmtree(tmp)
for _ in range(50):
    try: os.rmdir(cg); break
    except OSError: time.sleep(0.1)
PY
