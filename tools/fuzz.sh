#!/usr/bin/env bash
# Fuzzes the model header parsers (GGUF, safetensors), the learned-graph loader, the
# fault-trace reader and simulate's reading of a trace's region, and the keeper and
# share wire protocols, and the remote cache's index file, for SECONDS each (default 20).
# Installs cargo-fuzz if missing. Works on the stable toolchain: RUSTC_BOOTSTRAP=1 lets
# stable rustc take the -Z sanitizer flags cargo-fuzz passes (no nightly needed).
# The first run builds the fuzzers (about 3 minutes on 2 cores); crashes are saved
# under fuzz/artifacts/<target>/ and reproduced with
#   RUSTC_BOOTSTRAP=1 cargo fuzz run <target> fuzz/artifacts/<target>/<file>
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds="${1:-20}"

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz: installing cargo-fuzz" >&2
  cargo install --locked cargo-fuzz
fi

export RUSTC_BOOTSTRAP=1
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
for target in gguf safetensors learned_graph trace_reader trace_region keeper_protocol share_protocol cache_index; do
  mkdir -p "corpus/$target"
  echo "fuzz: $target for ${seconds}s" >&2
  # Seeds are checked in; the growing corpus is not.
  if ! cargo fuzz run "$target" "corpus/$target" "seeds/$target" -- \
    -max_total_time="$seconds" -rss_limit_mb=2048 -max_len=65536 >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "fuzz: $target failed (a crash is saved under fuzz/artifacts/$target/)" >&2
    exit 1
  fi
  grep -E "^Done" "$log" >&2
done
