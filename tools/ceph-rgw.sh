#!/usr/bin/env bash
# A throwaway single-node Ceph cluster with the RADOS Gateway (S3) on loopback, for the
# remote-tier tests and the benchmark (issue 24). Debian's packages, no containers, no
# systemd: every daemon runs directly, in the foreground of a detached session, with all
# of its state (conf, keyrings, mon store, OSD block file, logs, sockets, pid files) under
# DIR, so it cannot clash with /etc/ceph, /var/lib/ceph or another cluster on the machine.
#
#   tools/ceph-rgw.sh start DIR        start (or reuse) the cluster; last stdout line: DIR/env
#   tools/ceph-rgw.sh stop DIR         kill its daemons, wait for them, remove DIR's data
#   tools/ceph-rgw.sh restart-rgw DIR [DOWN]
#                                      stop the gateway only, keep it down DOWN seconds
#                                      (default 0), start it again on the same port
#   tools/ceph-rgw.sh stop-rgw DIR     stop the gateway only (mon and OSD keep running)
#   tools/ceph-rgw.sh start-rgw DIR    start it again (same port, keys, bucket); waits for S3
#   tools/ceph-rgw.sh status DIR       exit 0 if all daemons run and the gateway answers S3
#
# DIR/env is shell-sourceable (`set -a; . DIR/env; set +a`) and holds AWS_ENDPOINT_URL,
# AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ALLOW_HTTP,
# HYPEROFFLOAD_S3_BUCKET (and CEPH_CONF for the `ceph`/`radosgw-admin` CLIs).
#
# Knobs (environment): CEPH_RGW_STORE=bluestore|memstore (default bluestore, on a sparse
# file DIR/osd/block), CEPH_RGW_OSD_SIZE (bytes of the block file / memstore, default
# 32 GiB), CEPH_RGW_TIMEOUT (seconds for each wait, default 60), CEPH_RGW_BUCKET
# (default hyperoffload).
# Progress goes to stderr; see docs/ceph-rgw.md for timings and caveats.
set -euo pipefail

PROG=ceph-rgw
MARKER=.ceph-rgw          # written into DIR first; stop refuses a DIR without it
STORE=${CEPH_RGW_STORE:-bluestore}
OSD_SIZE=${CEPH_RGW_OSD_SIZE:-$((32 << 30))}
TIMEOUT=${CEPH_RGW_TIMEOUT:-60}
BUCKET=${CEPH_RGW_BUCKET:-hyperoffload}
REGION=us-east-1
S3_UID=hyperoffload
# ceph-mon pulls ceph-base (monmaptool); ceph-common has the CLIs. No ceph-mgr: nothing
# here needs it (see the conf). curl signs the S3 checks, python3 picks ports and keys.
PACKAGES=(ceph-mon ceph-osd ceph-common radosgw curl python3)
DAEMONS=(mon.a osd.0 client.rgw.a)   # start order; stopped in reverse

log() { echo "$PROG: $*" >&2; }
die() { echo "$PROG: error: $*" >&2; exit 1; }

usage() {
  echo "usage: $0 start|stop|status|stop-rgw|start-rgw DIR | restart-rgw DIR [DOWN]" >&2
  exit 2
}

# ---------------------------------------------------------------------------------------
# Packages

missing_packages() {
  local pkg
  for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" ||
      echo "$pkg"
  done
}

install_packages() {
  local missing
  mapfile -t missing < <(missing_packages)
  ((${#missing[@]})) || return 0
  [ "$(id -u)" -eq 0 ] || die "need root to install ${missing[*]} (or install them yourself)"
  # Tests start several clusters at once: one installs, the others wait for it and then
  # find nothing missing (dpkg's own lock fails at once rather than wait).
  exec 7>"${TMPDIR:-/tmp}/hyperoffload-ceph-install.lock"
  flock -w 1800 7 || die "another install of ${missing[*]} did not finish within 30 min"
  mapfile -t missing < <(missing_packages)
  if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    local apt=(apt-get -o DPkg::Lock::Timeout=600)
    # apt's lists may be absent on a fresh image; update only when the install fails.
    "${apt[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 || {
      "${apt[@]}" update -qq >/dev/null
      "${apt[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    }
  fi
  exec 7>&-
}

# ---------------------------------------------------------------------------------------
# Helpers

# A TCP port on 127.0.0.1 that nothing listens on now (the kernel's pick for port 0).
# Outside the OSD's messenger range (6800-7300) so the OSD cannot take it later.
free_port() {
  python3 - <<'EOF'
import socket
while True:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    if not 6800 <= p <= 7300:
        print(p)
        break
EOF
}

rand_key() { # length alphabet
  python3 -c "import secrets,sys; print(''.join(secrets.choice(sys.argv[2]) for _ in range(int(sys.argv[1]))))" "$1" "$2"
}

pidfile() { echo "$D/run/$1.pid"; }

# The pid of daemon $1 if it runs (checked against /proc, so a stale pid file or a
# recycled pid that is not our daemon on our conf reads as "not running").
daemon_pid() {
  local f pid
  f=$(pidfile "$1")
  [ -s "$f" ] || return 1
  pid=$(<"$f")
  [ -r "/proc/$pid/cmdline" ] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$D/ceph.conf" || return 1
  # A zombie has exited already.
  [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ] || return 1
  echo "$pid"
}

# Last lines of a daemon's logs, for error messages.
log_tail() {
  local f
  for f in "$D/log/$1.log" "$D/log/$1.out"; do
    [ -s "$f" ] || continue
    echo "--- tail of $f" >&2
    tail -n 20 "$f" >&2
  done
}

# Starts daemon $1 (a Ceph name) running "${@:2}" in the foreground (-f) of its own
# session, so it outlives this script and the caller's process group; stdin/stdout/stderr
# and the lock fd are detached so a caller capturing our output (cargo test) gets EOF
# when we exit.
launch() {
  local name=$1
  shift
  setsid "$@" -f -c "$D/ceph.conf" </dev/null >>"$D/log/$name.out" 2>&1 9>&- &
  echo $! >"$(pidfile "$name")"
}

# " with status N" for daemon $1 if this script launched it and it has exited (a daemon
# from an earlier invocation is not our child: nothing to report). Ceph's daemons often
# exit before their log is flushed, so the status may be all there is.
exit_status() {
  local pid status
  pid=$(<"$(pidfile "$1")") 2>/dev/null || return 0
  wait "$pid" 2>/dev/null && status=0 || status=$?
  [ "$status" != 127 ] || return 0
  echo -n " with status $status"
  [ "$status" != 28 ] || echo -n " (ENOSPC: the filesystem under $D is nearly full)"
}

# Runs "$@" until it succeeds or TIMEOUT seconds pass; on timeout names $what, shows
# the tail of $who's log and fails.
wait_for() { # what who cmd...
  local what=$1 who=$2 deadline=$((SECONDS + TIMEOUT))
  shift 2
  until "$@" >/dev/null 2>&1; do
    if [ -n "$who" ] && ! daemon_pid "$who" >/dev/null; then
      log_tail "$who"
      die "$what: $who exited$(exit_status "$who")"
    fi
    if ((SECONDS >= deadline)); then
      [ -z "$who" ] || log_tail "$who"
      die "$what: not after ${TIMEOUT}s"
    fi
    sleep 0.2
  done
}

ceph_cli() { timeout 30 ceph -c "$D/ceph.conf" --connect-timeout 10 "$@"; }

# ---------------------------------------------------------------------------------------
# S3 requests (SigV4 by curl) against the gateway described by DIR/env

s3() { # curl args...; path relative to the endpoint
  curl -sS --max-time 30 --aws-sigv4 "aws:amz:$REGION:s3" \
    --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" \
    -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" "$@"
}

load_env() { load_env_file "$D/env"; }

load_env_file() {
  [ -s "$1" ] || return 1
  set -a
  # shellcheck disable=SC1090
  . "$1"
  set +a
}

# The gateway answers an authenticated S3 request (HEAD of the bucket) with 200.
s3_ready() {
  local code
  code=$(s3 -o /dev/null -w '%{http_code}' -I "$AWS_ENDPOINT_URL/$HYPEROFFLOAD_S3_BUCKET") || return 1
  [ "$code" = 200 ]
}

# The semantics the pager relies on: byte-exact round trip, ranged GET conditional on
# the ETag (206), and 412 for a stale ETag.
s3_selftest() {
  local url="$AWS_ENDPOINT_URL/$HYPEROFFLOAD_S3_BUCKET/.ceph-rgw-selftest" tmp etag code
  tmp=$D/selftest   # inside DIR, so a failed test leaves nothing elsewhere
  rm -rf "$tmp" && mkdir -p "$tmp"
  head -c 65536 /dev/urandom >"$tmp/obj"
  s3 -f -T "$tmp/obj" "$url" -o /dev/null || die "self-test: PUT failed"
  s3 -f -D "$tmp/h" -o "$tmp/back" "$url" || die "self-test: GET failed"
  cmp -s "$tmp/obj" "$tmp/back" || die "self-test: GET returned other bytes than the PUT"
  etag=$(tr -d '\r' <"$tmp/h" | awk 'tolower($1)=="etag:" {print $2}')
  [ -n "$etag" ] || die "self-test: no ETag in the GET response"
  code=$(s3 -o "$tmp/range" -w '%{http_code}' -H "Range: bytes=1000-4999" -H "If-Match: $etag" "$url")
  [ "$code" = 206 ] || die "self-test: ranged GET with If-Match gave $code, not 206"
  cmp -s "$tmp/range" <(tail -c +1001 "$tmp/obj" | head -c 4000) ||
    die "self-test: ranged GET returned other bytes"
  code=$(s3 -o /dev/null -w '%{http_code}' -H "Range: bytes=0-99" -H 'If-Match: "0123456789abcdef0123456789abcdef"' "$url")
  [ "$code" = 412 ] || die "self-test: If-Match with a wrong ETag gave $code, not 412"
  s3 -f -X DELETE "$url" -o /dev/null || die "self-test: DELETE failed"
  rm -rf "$tmp"
}

# ---------------------------------------------------------------------------------------
# Cluster

write_conf() { # fsid mon_port rgw_port
  cat >"$D/ceph.conf" <<EOF
# Generated by tools/ceph-rgw.sh: a throwaway single-node cluster, everything under DIR.
[global]
fsid = $1
mon_host = [v2:127.0.0.1:$2]
mon_initial_members = a
public_network = 127.0.0.0/8
ms_bind_ipv6 = false
ms_bind_msgr1 = false
keyring = $D/keyring
run_dir = $D/run
admin_socket = $D/run/\$name.asok
log_file = $D/log/\$name.log
crash_dir = $D/crash
mon_data = $D/mon
osd_data = $D/osd
rgw_data = $D/rgw
# The cluster log would go to /var/log/ceph/ceph.log: keep everything inside DIR.
mon_cluster_log_to_file = false
log_to_stderr = false
err_to_stderr = false
# One OSD: one copy of everything; the warnings this would raise are expected here.
osd_pool_default_size = 1
osd_pool_default_min_size = 1
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
osd_crush_chooseleaf_type = 0
# No mgr runs, so no autoscaler: small fixed PG counts (rgw makes 6 pools, 8 PGs each)
# instead of 32 per pool, which on a single OSD would hit mon_max_pg_per_osd (250) at
# the eighth pool; the limit is raised too, for headroom.
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
mon_max_pg_per_osd = 1000
auth_allow_insecure_global_id_reclaim = false
mon_warn_on_insecure_global_id_reclaim_allowed = false
# No mgr runs (nothing here needs one): the mon would report MGR_DOWN (HEALTH_WARN) once
# this grace after mkfs (default 120 s) has passed; a year keeps health at HEALTH_OK.
mon_mgr_mkfs_grace = 31536000
# The root filesystem is shared with everything else; its free space is not this
# cluster's health. Below mon_data_avail_crit (default 5 % of the filesystem) the mon
# refuses to start (exit 28, ENOSPC) without a word in its log: on a 250 GiB disk that is
# any less than 12.5 GiB free, far more than this cluster ever writes.
mon_data_avail_warn = 1
mon_data_avail_crit = 0
# Startup is a chain of map changes (OSD boot, then rgw's pools one by one), each waiting
# for the mon's proposal interval (1 s by default): 0.05 s cuts start from ~25 s.
paxos_propose_interval = 0.05
paxos_min_wait = 0.01
# Quiet logs: errors still go to DIR/log/NAME.log.
debug_rocksdb = 0/0
debug_bluestore = 0/0
debug_bluefs = 0/0
debug_bdev = 0/0

[osd]
osd_objectstore = $STORE
# bluestore on a sparse file, DIR/osd/block (the default path when bluestore_block_path
# is unset; setting it to that same path makes mkfs loop on its own symlink).
bluestore_block_create = true
bluestore_block_size = $OSD_SIZE
# A fresh, empty store: nothing to check.
bluestore_fsck_on_mkfs = false
memstore_device_bytes = $OSD_SIZE
# The default target (4 GiB) would let the OSD's caches take a sixth of the machine.
osd_memory_target = 1073741824

[client.rgw.a]
rgw_frontends = beast endpoint=127.0.0.1:$3
# No rgw_dns_name: every request is path-style (http://127.0.0.1:PORT/BUCKET/KEY), which
# is what clients given an endpoint URL send (object_store's default).
rgw_enable_usage_log = false
rgw_enable_ops_log = false
EOF
}

start_cluster() {
  local fsid mon_port rgw_port osd_uuid access secret
  fsid=$(cat /proc/sys/kernel/random/uuid)
  osd_uuid=$(cat /proc/sys/kernel/random/uuid)
  mon_port=$(free_port)
  rgw_port=$(free_port)
  while [ "$rgw_port" = "$mon_port" ]; do rgw_port=$(free_port); done
  mkdir -p "$D"/{run,log,crash,mon,osd,rgw}
  write_conf "$fsid" "$mon_port" "$rgw_port"
  echo "$rgw_port" >"$D/rgw.port"

  # Keys: one keyring for every entity; the mon imports it at mkfs, so the OSD and the
  # gateway are authorized from the start (no `ceph auth` round trips).
  local kr="$D/keyring"
  ceph-authtool "$kr" --create-keyring --gen-key -n mon. --cap mon 'allow *' >/dev/null
  ceph-authtool "$kr" --gen-key -n client.admin \
    --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' --cap mds 'allow *' >/dev/null
  ceph-authtool "$kr" --gen-key -n osd.0 \
    --cap mon 'allow profile osd' --cap osd 'allow *' --cap mgr 'allow profile osd' >/dev/null
  ceph-authtool "$kr" --gen-key -n client.rgw.a \
    --cap mon 'allow rw' --cap osd 'allow rwx' --cap mgr 'allow rw' >/dev/null
  chmod 600 "$kr"

  log "mon on 127.0.0.1:$mon_port"
  monmaptool --create --enable-all-features --fsid "$fsid" --addv a "[v2:127.0.0.1:$mon_port]" "$D/monmap" >/dev/null
  ceph-mon -c "$D/ceph.conf" --mkfs -i a --monmap "$D/monmap" --keyring "$kr" \
    >>"$D/log/mon.a.out" 2>&1 || { log_tail mon.a; die "ceph-mon --mkfs failed"; }
  launch mon.a ceph-mon -i a
  wait_for "monitor quorum" mon.a ceph_cli mon stat

  log "osd.0 ($STORE, $((OSD_SIZE >> 30)) GiB)"
  [ "$(ceph_cli osd new "$osd_uuid" 0)" = 0 ] || die "ceph osd new did not give id 0"
  ceph-osd -c "$D/ceph.conf" -i 0 --mkfs --osd-uuid "$osd_uuid" \
    >>"$D/log/osd.0.out" 2>&1 || { log_tail osd.0; die "ceph-osd --mkfs failed"; }
  launch osd.0 ceph-osd -i 0
  wait_for "osd.0 up" osd.0 osd_up

  log "radosgw on 127.0.0.1:$rgw_port"
  launch client.rgw.a radosgw -n client.rgw.a
  wait_for "radosgw listening on 127.0.0.1:$rgw_port" client.rgw.a \
    curl -s -o /dev/null --max-time 2 "http://127.0.0.1:$rgw_port/"

  # The shapes of AWS keys (20 upper-case alphanumerics, 40 base64-ish characters) without
  # characters that need quoting anywhere.
  access=$(rand_key 20 ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789)
  secret=$(rand_key 40 ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789)
  timeout 60 radosgw-admin -c "$D/ceph.conf" user create --uid="$S3_UID" \
    --display-name="hyperoffload tests" --access-key="$access" --secret-key="$secret" \
    >>"$D/log/radosgw-admin.out" 2>&1 || { log_tail radosgw-admin; die "radosgw-admin user create failed"; }

  cat >"$D/env.tmp" <<EOF
AWS_ENDPOINT_URL=http://127.0.0.1:$rgw_port
AWS_ACCESS_KEY_ID=$access
AWS_SECRET_ACCESS_KEY=$secret
AWS_REGION=$REGION
AWS_ALLOW_HTTP=true
HYPEROFFLOAD_S3_BUCKET=$BUCKET
CEPH_CONF=$D/ceph.conf
EOF
  chmod 600 "$D/env.tmp"
  load_env_file "$D/env.tmp"
  local code
  code=$(s3 -o "$D/log/create-bucket.out" -w '%{http_code}' -X PUT "$AWS_ENDPOINT_URL/$BUCKET") ||
    die "bucket $BUCKET: PUT failed"
  [ "$code" = 200 ] || { cat "$D/log/create-bucket.out" >&2; die "bucket $BUCKET: PUT gave $code"; }
  wait_for "S3 HEAD of bucket $BUCKET" client.rgw.a s3_ready
  s3_selftest
  # The env file appears last and atomically: its presence means "the cluster is up".
  mv "$D/env.tmp" "$D/env"
}

osd_up() {
  ceph_cli osd dump -f json 2>/dev/null | python3 -c '
import json, sys
d = json.load(sys.stdin)
sys.exit(0 if any(o["osd"] == 0 and o["up"] for o in d["osds"]) else 1)'
}

# The mon and the OSD of a completed start run (the gateway may not).
core_up() {
  daemon_pid mon.a >/dev/null && daemon_pid osd.0 >/dev/null && load_env
}

# Every daemon of DIR runs and the gateway answers S3 with DIR's keys.
cluster_up() {
  local n
  for n in "${DAEMONS[@]}"; do daemon_pid "$n" >/dev/null || return 1; done
  load_env && s3_ready
}

# SIGTERM, then SIGKILL after 10 s; waits until the process is gone (it is not our child
# when started by an earlier invocation, so `wait` cannot be used).
kill_daemon() {
  local name=$1 pid i
  pid=$(daemon_pid "$name") || { rm -f "$(pidfile "$name")"; return 0; }
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do
    daemon_pid "$name" >/dev/null || break
    sleep 0.1
  done
  if daemon_pid "$name" >/dev/null; then
    log "$name (pid $pid) ignored SIGTERM for 10 s; SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
      daemon_pid "$name" >/dev/null || break
      sleep 0.1
    done
    ! daemon_pid "$name" >/dev/null || die "$name (pid $pid) does not exit"
  fi
  rm -f "$(pidfile "$name")"
}

stop_all() {
  local i
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do kill_daemon "${DAEMONS[i]}"; done
}

# The cluster's files (what start creates besides the marker and the lock).
remove_cluster_files() {
  rm -rf "$D"/{run,log,crash,mon,osd,rgw,selftest} "$D"/{ceph.conf,keyring,monmap,env,env.tmp,rgw.port}
}

# Removes what start created (not DIR itself if it holds anything else).
remove_data() {
  remove_cluster_files
  rm -f "$D/$MARKER" "$D/.lock"
  rmdir "$D" 2>/dev/null || true
}

# ---------------------------------------------------------------------------------------
# Commands

cmd_start() {
  case $STORE in bluestore | memstore) ;; *) die "CEPH_RGW_STORE=$STORE: bluestore or memstore" ;; esac
  [[ $OSD_SIZE =~ ^[0-9]+$ ]] || die "CEPH_RGW_OSD_SIZE=$OSD_SIZE: a number of bytes"
  install_packages
  if [ -e "$D" ] && [ ! -e "$D/$MARKER" ] && [ -n "$(ls -A "$D" 2>/dev/null)" ]; then
    die "$D exists, is not empty and was not made by $0; refusing to use it"
  fi
  mkdir -p "$D"
  touch "$D/$MARKER"
  lock
  if cluster_up; then
    log "reusing the cluster in $D ($AWS_ENDPOINT_URL)"
  elif core_up; then
    # Only the gateway is down (stop-rgw, or it crashed): bring it back on the same port
    # rather than wiping a cluster whose endpoint and keys a caller may still hold.
    log "reusing the cluster in $D; starting its gateway again"
    daemon_pid client.rgw.a >/dev/null || launch client.rgw.a radosgw -n client.rgw.a
    wait_for "radosgw answering S3 on $AWS_ENDPOINT_URL" client.rgw.a s3_ready
  else
    # A half-started or crashed cluster: start over rather than repair it.
    stop_all
    remove_cluster_files
    local t0=$SECONDS
    # A failed or interrupted start leaves no daemon behind (its logs stay in DIR
    # until stop).
    trap 'stop_all' EXIT
    trap 'exit 130' INT TERM
    start_cluster
    trap - EXIT INT TERM
    log "up in $((SECONDS - t0)) s: $AWS_ENDPOINT_URL bucket $BUCKET"
  fi
  echo "$D/env"
}

cmd_stop() {
  [ -d "$D" ] || return 0
  [ -e "$D/$MARKER" ] || die "$D was not made by $0; refusing to touch it"
  lock
  stop_all
  remove_data
}

# The gateway alone, for fault tests (the store going away mid-run); the mon and the OSD
# keep running, the port and the keys stay the same.
cmd_stop_rgw() {
  need_cluster
  lock
  kill_daemon client.rgw.a
  log "radosgw stopped ($AWS_ENDPOINT_URL refuses connections)"
}

cmd_start_rgw() {
  need_cluster
  lock
  if ! daemon_pid client.rgw.a >/dev/null; then
    launch client.rgw.a radosgw -n client.rgw.a
  fi
  wait_for "radosgw answering S3 on $AWS_ENDPOINT_URL" client.rgw.a s3_ready
  log "radosgw up on $AWS_ENDPOINT_URL"
}

# restart-rgw DIR [DOWN]: stop the gateway, keep it down DOWN seconds (default 0), start it.
cmd_restart_rgw() {
  local down=${1:-0}
  [[ $down =~ ^[0-9]+([.][0-9]+)?$ ]] || die "restart-rgw: DOWN must be seconds, not '$down'"
  cmd_stop_rgw
  sleep "$down"
  cmd_start_rgw
}

need_cluster() {
  if ! [ -e "$D/$MARKER" ] || ! load_env; then die "no cluster in $D (run start first)"; fi
}

cmd_status() {
  [ -e "$D/$MARKER" ] || exit 1
  cluster_up
}

# Serializes commands on one DIR (tests may start it concurrently). fd 9 is closed in
# every daemon (launch), so the lock ends with this script.
lock() {
  exec 9>>"$D/.lock"
  flock -w "$((TIMEOUT * 3))" 9 || die "another $0 holds $D/.lock"
}

[ $# -ge 2 ] || usage
cmd=$1
D=$2
shift 2
case $D in /*) ;; *) D=$PWD/$D ;; esac
D=${D%/}
case $cmd in
  start) cmd_start ;;
  stop) cmd_stop ;;
  restart-rgw) cmd_restart_rgw "$@" ;;
  stop-rgw) cmd_stop_rgw ;;
  start-rgw) cmd_start_rgw ;;
  status) cmd_status ;;
  *) usage ;;
esac
