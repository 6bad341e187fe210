#!/usr/bin/env bash
# The remote-tier benchmark (issue 24): a llama-shaped Q8_0 model of about 3 GiB in a
# local Ceph RADOS Gateway (tools/ceph-rgw.sh), read by llama-completion under
# `hyperoffload run` through `hyperoffload mount`. Prints one line per run and the
# medians (with min-max) of:
#   ttft    time to the first token (llama-completion -n 1, wall time), cold: empty
#           cache tier and page cache dropped, --budget 50 %; against downloading the
#           whole object (curl) and then running the same command on the local copy.
#           Each run also prints the CPU-seconds of its program (with the pager), of
#           the mount or the download, and of the gateway's daemons over the run.
#   decode  decode tok/s (llama's eval rate, -n $TOKENS) with the whole model in the
#           cache tier, --budget 50 %, against the same command on the local file.
#   fetch   bytes fetched from the remote per token with a cache tier of 50 % of the
#           model at --budget $FETCH_BUDGET: the difference of two cold runs (-n 4 and
#           -n $((4 + FETCH_TOKENS))) over FETCH_TOKENS, against model - budget - cache.
# Sides alternate within each round. Root required (drops the page cache).
# MOUNT_ARGS (e.g. --no-passthrough, --block 8M) go to every mount of every part.
#   RUNS (3), FETCH_RUNS (RUNS), TOKENS (16), FETCH_TOKENS (8), FETCH_BUDGET (25%),
#   PARTS (ttft,decode,fetch)
#   HYPEROFFLOAD_BENCH_MODEL_SIZE (3G), HYPEROFFLOAD_REMOTE_BENCH_DIR (target/remote-bench)
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"

runs="${RUNS:-3}"
tokens="${TOKENS:-16}"
fetch_tokens="${FETCH_TOKENS:-8}"
fetch_budget="${FETCH_BUDGET:-25}"
parts="${PARTS:-ttft,decode,fetch}"
size="${HYPEROFFLOAD_BENCH_MODEL_SIZE:-3G}"
work="${HYPEROFFLOAD_REMOTE_BENCH_DIR:-$root/target/remote-bench}"
ho="$root/target/release/hyperoffload"
prompt="The capital of France is"

[ -x "$ho" ] || { echo "build first: cargo build --release --workspace" >&2; exit 1; }
small="$(bash tools/fetch-model.sh | tail -n 1)"
bin="$(bash tools/build-llama.sh | tail -n 1)"
mkdir -p "$work"
model="$work/synth-llama-$size-q8_0.gguf"
if [ ! -f "$model" ]; then
  "$ho" synth --like "$small" --size "$size" --type Q8_0 --order file --force \
    --out "$model.tmp" >&2
  mv "$model.tmp" "$model"
fi
model_bytes="$(stat -c %s "$model")"
half=$((model_bytes / 2))

cluster="$work/rgw"
env_file="$(bash tools/ceph-rgw.sh start "$cluster" | tail -n 1)"
set -a; . "$env_file"; set +a
mnt="$work/mnt"
mkdir -p "$mnt"
mount_pid=""
cleanup() {
  [ -n "$mount_pid" ] && kill -TERM "$mount_pid" 2>/dev/null && wait "$mount_pid" 2>/dev/null
  bash "$root/tools/ceph-rgw.sh" stop "$cluster" >/dev/null 2>&1 || true
}
trap cleanup EXIT

# curl with SigV4; the keys go in its arguments only, never to the output.
s3() {
  curl -sSf --aws-sigv4 "aws:amz:${AWS_REGION:-us-east-1}:s3" \
    --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" \
    -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" "$@"
}
url="$AWS_ENDPOINT_URL/$HYPEROFFLOAD_S3_BUCKET/bench/model.gguf"
if ! s3 -o /dev/null -I "$url" 2>/dev/null; then
  echo "uploading $(numfmt --to=iec "$model_bytes") to the gateway" >&2
  s3 -o /dev/null -T "$model" "$url"
fi

# timed NAME CMD...: runs CMD with its stderr in $work/NAME.err (its stdout is the
# caller's); sets timed_wall (seconds) and timed_cpu (its user + system seconds).
timed() {
  local name="$1" TIMEFORMAT='%R %U %S' user sys; shift
  { time "$@" 2>"$work/$name.err"; } 2>"$work/$name.time"
  read -r timed_wall user sys <"$work/$name.time"
  timed_cpu="$(echo "$user + $sys" | bc -l)"
}
# CPU-seconds (user + system) that processes PID... have used so far; 0 for a gone one.
cpu_s() {
  local pid total=0 ticks
  for pid in "$@"; do
    [ -r "/proc/$pid/stat" ] || continue
    # Fields 14 and 15 of stat, counted after the command name's closing parenthesis.
    ticks=$(sed -E 's/.*\) //' "/proc/$pid/stat" | awk '{ print $12 + $13 }')
    total=$((total + ticks))
  done
  echo "scale=2; $total / $(getconf CLK_TCK)" | bc -l
}
# The gateway's daemons (monitor, OSD, radosgw): the store's CPU on this machine.
store_pids() { cat "$cluster"/run/*.pid 2>/dev/null; }
store_cpu() { cpu_s $(store_pids); }
drop_caches() { sync; echo 3 > /proc/sys/vm/drop_caches; }

# mount_start CACHE_DIR [--cache-size N]: the bucket's bench/ prefix on $mnt, with
# MOUNT_ARGS.
mount_start() {
  local cache="$1"; shift
  : > "$work/mount.log"
  # shellcheck disable=SC2086 # MOUNT_ARGS is a list of arguments
  "$ho" mount "s3://$HYPEROFFLOAD_S3_BUCKET/bench" "$mnt" --cache-dir "$cache" \
    --stats "$work/mount-stats.json" ${MOUNT_ARGS:-} "$@" 2>"$work/mount.log" &
  mount_pid=$!
  for _ in $(seq 600); do
    grep -q "hyperoffload: mounted" "$work/mount.log" && return 0
    kill -0 "$mount_pid" 2>/dev/null || { cat "$work/mount.log" >&2; exit 1; }
    sleep 0.05
  done
  echo "mount not up" >&2; cat "$work/mount.log" >&2; exit 1
}
mount_stop() {
  mount_cpu="$(cpu_s "$mount_pid")"
  kill -TERM "$mount_pid"; wait "$mount_pid" || true; mount_pid=""
}
remote_bytes() {
  python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["remote"]["bytes"])' \
    "$work/mount-stats.json"
}
# How the mount's files were opened: with passthrough (the kernel reads the cache file)
# or through the mount, and how long checking the warm cache tier's blocks took.
opens() {
  python3 -c 'import json,sys; s=json.load(open(sys.argv[1]))
print("opens: %d with passthrough, %d through the mount %s; %d reads reached the mount"
      % (s["passthrough_opens"], s["fuse_opens"]["total"], s["fuse_opens"], s["reads"]))' \
    "$work/mount-stats.json"
  grep -o 'checked in [0-9.]* s' "$work/mount.log" || true
}

# completion MODEL N BUDGET: runs llama-completion under the pager; its stderr is in
# $work/llama.err, its text in $work/llama.out, its CPU-seconds (the program and the
# pager in it) in $work/llama.cpu; prints the wall time.
completion() {
  timed llama "$ho" run --budget "$3" -- "$bin/llama-completion" -m "$1" -p "$prompt" \
    -n "$2" --temp 0 --seed 1 -t 2 -no-cnv --no-display-prompt </dev/null >"$work/llama.out"
  echo "$timed_cpu" >"$work/llama.cpu"
  echo "$timed_wall"
}
eval_rate() {
  grep -E '_perf[a-z_]*print: +eval time' "$work/llama.err" \
    | sed -E 's/.*, +([0-9.]+) tokens per second.*/\1/'
}
summary() { # NAME VALUES...: median (min-max)
  local name="$1"; shift
  printf '%s\n' "$@" | sort -g | awk -v name="$name" '
    { v[NR] = $1 } END { m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2;
      printf "%s: median %.3f (%.3f-%.3f, %d runs)\n", name, m, v[1], v[NR], NR }'
}

echo "model $model ($model_bytes bytes), llama $bin, $(nproc) cores"
if [[ ",$parts," == *,ttft,* ]]; then
  mounted=(); downloaded=()
  for round in $(seq "$runs"); do
    for side in mount download; do
      [ $((round % 2)) = 0 ] && side=$([ "$side" = mount ] && echo download || echo mount)
      drop_caches
      if [ "$side" = mount ]; then
        rm -rf "$work/cache-cold"
        store0="$(store_cpu)"
        mount_start "$work/cache-cold"
        t="$(completion "$mnt/model.gguf" 1 50%)"
        mount_stop
        store="$(echo "$(store_cpu) - $store0" | bc -l)"
        mounted+=("$t")
        echo "ttft mount: remote bytes $(remote_bytes); $(tail -n 1 "$work/llama.err")"
        echo "ttft mount CPU-s: program $(<"$work/llama.cpu"), mount $mount_cpu, store $store"
      else
        rm -f "$work/local.gguf"
        store0="$(store_cpu)"
        timed download s3 -o "$work/local.gguf" "$url"
        got="$timed_wall" got_cpu="$timed_cpu"
        store="$(echo "$(store_cpu) - $store0" | bc -l)"
        run="$(completion "$work/local.gguf" 1 50%)"
        t="$(echo "$got + $run" | bc -l)"
        echo "ttft download $got s + run $run s"
        echo "ttft download CPU-s: program $(<"$work/llama.cpu"), download $got_cpu, store $store"
        downloaded+=("$t")
      fi
      echo "ttft $side round $round: $t s"
    done
  done
  summary "ttft mount (s)" "${mounted[@]}"
  summary "ttft download then run (s)" "${downloaded[@]}"
fi

if [[ ",$parts," == *,decode,* ]]; then
  [ -f "$work/local.gguf" ] || s3 -o "$work/local.gguf" "$url"
  # The warm cache tier: the whole model read through the mount once.
  rm -rf "$work/cache-warm"
  mount_start "$work/cache-warm"
  cat "$mnt/model.gguf" > /dev/null
  mount_stop
  mounted=(); local_=()
  for round in $(seq "$runs"); do
    for side in mount local; do
      [ $((round % 2)) = 0 ] && side=$([ "$side" = mount ] && echo local || echo mount)
      if [ "$side" = mount ]; then
        mount_start "$work/cache-warm"
        completion "$mnt/model.gguf" "$tokens" 50% >/dev/null
        mount_stop
        fetched="$(remote_bytes)"
        r="$(eval_rate)"; mounted+=("$r")
        echo "decode mount round $round: $r tok/s (remote bytes $fetched)"
        opens
      else
        completion "$work/local.gguf" "$tokens" 50% >/dev/null
        r="$(eval_rate)"; local_+=("$r")
        echo "decode local round $round: $r tok/s"
      fi
    done
  done
  summary "decode mount, warm cache tier (tok/s)" "${mounted[@]}"
  summary "decode local disk (tok/s)" "${local_[@]}"
fi

if [[ ",$parts," == *,fetch,* ]]; then
  per=()
  for round in $(seq "${FETCH_RUNS:-$runs}"); do
    fetched=()
    for n in 4 $((4 + fetch_tokens)); do
      rm -rf "$work/cache-half"
      drop_caches
      mount_start "$work/cache-half" --cache-size "$half"
      completion "$mnt/model.gguf" "$n" "$fetch_budget%" >/dev/null
      mount_stop
      fetched+=("$(remote_bytes)")
      echo "fetch round $round: -n $n fetched ${fetched[-1]} bytes"
    done
    p=$(( (fetched[1] - fetched[0]) / fetch_tokens ))
    per+=("$p")
    echo "fetch round $round: $p bytes per token"
  done
  target=$(( model_bytes - model_bytes * fetch_budget / 100 - half ))
  summary "fetched per token (bytes), cache tier 50 %, budget $fetch_budget %" "${per[@]}"
  echo "model - budget - cache = $target bytes"
fi
