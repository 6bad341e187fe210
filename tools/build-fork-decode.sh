#!/usr/bin/env bash
# Compiles tests/victims/fork_decode.c (forked llama.cpp decoders of one mmap'd model)
# against the static llama.cpp libraries and headers tools/build-llama.sh caches, into
# OUT_DIR. Prints the binary's path as the last line on stdout.
#
# Usage: tools/build-fork-decode.sh OUT_DIR
# Environment: LLAMA_BIN_DIR, llama.cpp's bin directory (default: what
# tools/build-llama.sh prints, building it if need be); the libraries are in the build
# tree beside it (../build), the headers in its source (../src/llama.cpp).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:?usage: $0 OUT_DIR}
bin=${LLAMA_BIN_DIR:-$("$here/tools/build-llama.sh" | tail -n 1)}
root=$(cd "$bin/.." && pwd)
src=$root/src/llama.cpp
build=$root/build
for lib in src/libllama.a ggml/src/libggml.a ggml/src/libggml-cpu.a ggml/src/libggml-base.a; do
  [ -f "$build/$lib" ] || { echo "missing $build/$lib (a static llama.cpp build)" >&2; exit 1; }
done
mkdir -p "$out"
cc -O2 -Wall -I "$src/include" -I "$src/ggml/include" \
  -c "$here/tests/victims/fork_decode.c" -o "$out/fork_decode.o"
# C++ and OpenMP runtimes: libllama is C++, ggml's CPU backend is built with -fopenmp.
c++ "$out/fork_decode.o" "$build/src/libllama.a" "$build/ggml/src/libggml.a" \
  "$build/ggml/src/libggml-cpu.a" "$build/ggml/src/libggml-base.a" \
  -fopenmp -lpthread -lm -o "$out/fork_decode"
echo "$out/fork_decode"
