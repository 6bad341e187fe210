#!/usr/bin/env bash
# A plain HTTP server for the remote tests: Debian's nginx on 127.0.0.1, serving a
# directory, with an access log of every request's method, URI, status, body bytes,
# Range and If-Match.
#   tools/nginx.sh start WORK ROOT [PORT]   starts it (a free port unless PORT is given);
#                                           prints the port; WORK holds its config,
#                                           pid, logs (WORK/access.log)
#   tools/nginx.sh stop WORK                stops it (waits until it is gone)
# Idempotent: installs nginx-light when there is no nginx; `start` on a WORK whose
# server runs stops that one first; `stop` of a stopped server does nothing.
set -euo pipefail

cmd="${1:-}"
work="${2:-}"
[ -n "$cmd" ] && [ -n "$work" ] || { echo "usage: $0 start WORK ROOT [PORT] | stop WORK" >&2; exit 2; }

stop() {
  local pidfile="$work/nginx.pid"
  [ -s "$pidfile" ] || return 0
  local pid
  pid="$(cat "$pidfile")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -QUIT "$pid" 2>/dev/null || true
    for _ in $(seq 100); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.05
    done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

case "$cmd" in
  stop)
    stop
    ;;
  start)
    root="${3:?ROOT}"
    port="${4:-}"
    if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
      if [ "$(id -u)" -ne 0 ]; then
        echo "nginx.sh: need root to install nginx-light" >&2
        exit 1
      fi
      echo "nginx.sh: installing nginx-light" >&2
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq
      # policy-rc.d may refuse to start the system's nginx: fine, we run our own.
      apt-get install -y -qq --no-install-recommends nginx-light >/dev/null
    fi
    nginx_bin="$(command -v nginx || echo /usr/sbin/nginx)"
    mkdir -p "$work"
    work="$(cd "$work" && pwd)"
    root="$(cd "$root" && pwd)"
    stop
    if [ -z "$port" ]; then
      port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    fi
    user_line=""
    [ "$(id -u)" -eq 0 ] && user_line="user root;"
    cat >"$work/nginx.conf" <<EOF
$user_line
worker_processes 1;
daemon on;
pid $work/nginx.pid;
error_log $work/error.log warn;
events { worker_connections 256; }
http {
  log_format ho '\$request_method \$uri \$status \$body_bytes_sent range=\$http_range if_match=\$http_if_match';
  access_log $work/access.log ho;
  client_body_temp_path $work/tmp/body;
  proxy_temp_path $work/tmp/proxy;
  fastcgi_temp_path $work/tmp/fastcgi;
  uwsgi_temp_path $work/tmp/uwsgi;
  scgi_temp_path $work/tmp/scgi;
  sendfile on;
  keepalive_requests 100000;
  server {
    listen 127.0.0.1:$port;
    root $root;
    location / { }
  }
}
EOF
    mkdir -p "$work/tmp"
    : >"$work/access.log"
    "$nginx_bin" -p "$work" -c "$work/nginx.conf" -e "$work/error.log"
    for _ in $(seq 100); do
      if [ -s "$work/nginx.pid" ] && (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        echo "$port"
        exit 0
      fi
      sleep 0.05
    done
    echo "nginx.sh: nginx did not come up on 127.0.0.1:$port (see $work/error.log)" >&2
    stop
    exit 1
    ;;
  *)
    echo "usage: $0 start WORK ROOT [PORT] | stop WORK" >&2
    exit 2
    ;;
esac
