#!/usr/bin/env bash
# Makes BUILD_DIR/venv, a Python virtual environment with the official clients the tests use
# (tests/clients/requirements.txt, from PyPI). Does nothing when it is already there for the
# same requirements. Python never runs inside the services: this is test tooling.
#
#   scripts/python-env.sh                # build/venv
#   KVCM_BUILD_DIR=out scripts/python-env.sh
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR="${KVCM_BUILD_DIR:-build}"
VENV="$BUILD_DIR/venv"
REQUIREMENTS=tests/clients/requirements.txt
STAMP="$VENV/.requirements.sha256"
want="$(sha256sum "$REQUIREMENTS" | cut -d' ' -f1)"

if [[ -x "$VENV/bin/python3" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  echo "python-env: $VENV is up to date"
  exit 0
fi

echo "python-env: installing $(grep -cv '^\s*\(#\|$\)' "$REQUIREMENTS") client package(s) into $VENV"
rm -rf "$VENV"
mkdir -p "$BUILD_DIR"
python3 -m venv "$VENV"
"$VENV/bin/python3" -m pip install --quiet --disable-pip-version-check --no-input \
  -r "$REQUIREMENTS"
echo "$want" > "$STAMP"
"$VENV/bin/python3" -m pip list --disable-pip-version-check 2>/dev/null |
  grep -Ei '^(text-generation|openai) ' | sed 's/^/python-env:   /'
