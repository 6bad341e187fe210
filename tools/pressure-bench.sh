#!/usr/bin/env bash
# How fast the pager gives memory back to a memory hog, and takes it again after: a
# python reader of a model-like file under `hyperoffload run` in a memory cgroup, and
# beside it a hog that allocates and touches memory in steps up to a share of the
# cgroup, holds it, and exits. Samples the cgroup every 20 ms and prints when the
# reader's side (the cgroup's usage less the hog's resident set) fitted beside the
# hog, how low it went, and when it was back. Root required (cgroups).
#   LIMIT  the cgroup's limit in MiB (default 1024)     MODEL  the file in MiB (768)
#   HOG    the hog's share of the limit, % (60)          STEP   MiB per hog step (32)
#   PAUSE  seconds between hog steps (0.2)               BUDGET --budget (auto)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --workspace >&2
exec python3 - "$@" <<'PY'
import os, sys, time, subprocess, shutil, tempfile

MIB = 1 << 20
limit = int(os.environ.get("LIMIT", "1024")) * MIB
model_len = int(os.environ.get("MODEL", "768")) * MIB
hog = limit * int(os.environ.get("HOG", "60")) // 100
step = int(os.environ.get("STEP", "32")) * MIB
pause = os.environ.get("PAUSE", "0.2")
budget = os.environ.get("BUDGET", "auto")

v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
root = "/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/memory"
cg = os.path.join(root, f"hyperoffload-pressure-bench-{os.getpid()}")
os.mkdir(cg)
def cgfile(name): return os.path.join(cg, name)
def write(name, text):
    with open(cgfile(name), "w") as f: f.write(text)
def read(name):
    with open(cgfile(name)) as f: return f.read()
write("memory.max" if v2 else "memory.limit_in_bytes", str(limit))
usage_file = "memory.current" if v2 else "memory.usage_in_bytes"
def usage(): return int(read(usage_file))
def oom_kills():
    text = read("memory.events" if v2 else "memory.oom_control")
    return next(int(l.split()[1]) for l in text.splitlines() if l.startswith("oom_kill "))
def rss(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0
def enter(): 
    with open(cgfile("cgroup.procs"), "w") as f: f.write("0")

tmp = tempfile.mkdtemp(prefix="pressure-bench-")
model, stop, stats = (os.path.join(tmp, n) for n in ("model.gguf", "stop", "stats.json"))
with open(model, "wb") as f:
    chunk = os.urandom(MIB)
    for _ in range(model_len // MIB): f.write(chunk)
reader = r'''
import sys, os, mmap
m = mmap.mmap(os.open(sys.argv[1], os.O_RDONLY), 0, access=mmap.ACCESS_READ)
while not os.path.exists(sys.argv[2]):
    for at in range(0, len(m), 1 << 20): m[at]; m[at:at + (1 << 20)].count(b"x")
'''
hog_script = r'''
import sys, time
total, step, pause = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
held = []
while sum(map(len, held)) < total:
    b = bytearray(step); b[::4096] = b"\x01" * len(range(0, step, 4096)); held.append(b)
    time.sleep(pause)
time.sleep(pause * 4)
'''
args = ["target/release/hyperoffload", "run", "--quiet", "--stats", stats]
if budget != "auto": args += ["--budget", budget]
victim = subprocess.Popen(args + ["--", "python3", "-c", reader, model, stop], preexec_fn=enter)
samples = []
t0 = time.monotonic()
def sample(hog_pid=None):
    t = time.monotonic() - t0
    u = usage()
    h = rss(hog_pid) if hog_pid else 0
    samples.append((t, u, u - h, h))
    time.sleep(0.02)
while usage() < limit // 2 and victim.poll() is None and time.monotonic() - t0 < 120:
    sample()
before = usage()
hog_start = time.monotonic() - t0
hog_proc = subprocess.Popen(["python3", "-c", hog_script, str(hog), str(step), pause], preexec_fn=enter)
while hog_proc.poll() is None: sample(hog_proc.pid)
hog_end = time.monotonic() - t0
while victim.poll() is None and time.monotonic() - t0 < hog_end + 30 and usage() < 0.9 * before:
    sample()
back = time.monotonic() - t0
open(stop, "w").close()
victim.wait()
side = [(t, s) for t, _, s, _ in samples if hog_start <= t <= hog_end]
hog_full = next((t for t, _, _, h in samples if h >= 0.95 * hog), None)
fits = limit - hog
fitted = next((t for t, s in side if s <= fits), None)
lowest = min(s for _, s in side) if side else 0
print(f"cgroup v{2 if v2 else 1} limit {limit // MIB} MiB, model {model_len // MIB} MiB, "
      f"hog {hog // MIB} MiB in {step // MIB} MiB steps every {pause} s, --budget {budget}")
print(f"reader side before the hog: {before // MIB} MiB; lowest beside it: {lowest // MIB} MiB")
least_room = min((limit - u for t, u, _, _ in samples if hog_start <= t <= hog_end), default=0)
print(f"least room left in the cgroup while the hog ran: {least_room // MIB} MiB")
print("fitted beside the full hog (<= %d MiB): %s" % (fits // MIB,
      f"{fitted - hog_start:.2f} s after the hog started" if fitted is not None else "never"))
if hog_full is not None and fitted is not None:
    print(f"the hog held 95 % of its share {hog_full - hog_start:.2f} s after it started; "
          f"the reader fitted beside it {fitted - hog_full:+.2f} s from then")
print(f"hog ran {hog_end - hog_start:.2f} s (exit {hog_proc.returncode}); reader back to 90 % "
      f"{back - hog_end:.2f} s after it ended" if usage() >= 0.9 * before or back < hog_end + 30
      else "reader not back within 30 s")
print(f"reader exit {victim.returncode}, OOM kills {oom_kills()}")
try:
    import json
    history = json.load(open(stats))["budget_history"]
    print("budget history (s, MiB):", " ".join(f"{p['t_s']:.2f}:{p['bytes'] // MIB}" for p in history))
except (OSError, ValueError, KeyError):
    print("no stats (the reader was killed?)")
shutil.rmtree(tmp)
for _ in range(50):
    try: os.rmdir(cg); break
    except OSError: time.sleep(0.1)
PY
