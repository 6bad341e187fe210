#!/usr/bin/env bash
# Synthesizes the headline's llama-shaped Q8_0 model once into the model cache and
# prints its path (last line of stdout): the dense model the benchmarks share
# (tools/bench-llama.sh, tools/split-bench.sh).
#
#   bash tools/synth-dense.sh HYPEROFFLOAD SMALL_MODEL [SIZE]   (SIZE default 3G)
set -euo pipefail
cd "$(dirname "$0")/.."
hyperoffload="$1"
small="$2"
size="${3:-3G}"

models="${XDG_CACHE_HOME:-$HOME/.cache}/hyperoffload/models"
model="$models/synth-llama-$size-q8_0.gguf"
if [ ! -f "$model" ]; then
  mkdir -p "$models"
  "$hyperoffload" synth --like "$small" --size "$size" --type Q8_0 --order file --force \
    --out "$model.tmp"
  mv "$model.tmp" "$model"
fi
echo "$model"
