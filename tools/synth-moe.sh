#!/usr/bin/env bash
# Synthesizes a mixture of experts once into the model cache and prints its path (last
# line of stdout): the models the MoE benchmarks share. A model is keyed by its shape and
# by synth's own source, so a change to how synth writes models makes a new one.
#
#   bash tools/synth-moe.sh HYPEROFFLOAD SMALL_MODEL
#
#   SIZE (required), ROUTER (synth --router-locality; `off` for the independent router),
#   ARCH, TYPES (synth --type), ORDER, EXPERTS, EXPERTS_USED: required;
#   EXPERT_TYPE, EXPERT_FF_RATIO: optional (synth --expert-type, --expert-ff-ratio)
set -euo pipefail
cd "$(dirname "$0")/.."
hyperoffload="$1"
small="$2"
: "${SIZE:?}" "${ROUTER:?}" "${ARCH:?}" "${TYPES:?}" "${ORDER:?}" "${EXPERTS:?}" "${EXPERTS_USED:?}"
expert_type="${EXPERT_TYPE:-}"
ff_ratio="${EXPERT_FF_RATIO:-}"

synth_key="$(git rev-parse --short=12 HEAD:pager/src/model/synth 2>/dev/null || echo unversioned)"
models="${XDG_CACHE_HOME:-$HOME/.cache}/hyperoffload/models"
variant="$ARCH-$TYPES${expert_type:+-$expert_type}-$ORDER${ff_ratio:+-ff$ff_ratio}"
model="$models/moe${SIZE,,}-${EXPERTS}x$EXPERTS_USED-$ROUTER-$variant-$synth_key.gguf"
if [ ! -f "$model" ]; then
  mkdir -p "$models"
  echo "synth-moe: synthesizing $model" >&2
  start=$(date +%s%N)
  "$hyperoffload" synth --like "$small" --size "$SIZE" --type "$TYPES" --experts "$EXPERTS" \
    --experts-used "$EXPERTS_USED" --router-locality "$ROUTER" --arch "$ARCH" --order "$ORDER" \
    ${expert_type:+--expert-type "$expert_type"} ${ff_ratio:+--expert-ff-ratio "$ff_ratio"} \
    --out "$model.partial"
  mv "$model.partial" "$model"
  echo "synth-moe: synthesized in $(( ($(date +%s%N) - start) / 1000000 )) ms" >&2
fi
echo "$model"
