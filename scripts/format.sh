#!/usr/bin/env bash
# clang-format over every C++ and CUDA file git tracks, with the repository's .clang-format
# (Google style, 100 columns). clang-format 14, Debian 12's, is the one whose output is the
# reference; scripts/test.sh runs the check first.
#
#   scripts/format.sh            # rewrites the files in place
#   scripts/format.sh --check    # changes nothing; lists the files that differ, exits 1 if any
set -euo pipefail
cd "$(dirname "$0")/.."

CLANG_FORMAT="${CLANG_FORMAT:-clang-format-14}"
if ! command -v "$CLANG_FORMAT" >/dev/null; then
  echo "format: $CLANG_FORMAT not found (scripts/bootstrap.sh installs it)" >&2
  exit 2
fi

mapfile -t files < <(git ls-files '*.h' '*.cc' '*.cu' '*.cuh')
if [[ "${1:-}" != "--check" ]]; then
  printf '%s\0' "${files[@]}" | xargs -0 -n 64 "$CLANG_FORMAT" -i
  echo "format: ${#files[@]} files formatted"
  exit 0
fi

differ=()
for f in "${files[@]}"; do
  "$CLANG_FORMAT" "$f" | cmp -s - "$f" || differ+=("$f")
done
if ((${#differ[@]})); then
  echo "format: ${#differ[@]} of ${#files[@]} files differ from clang-format; scripts/format.sh" \
    "rewrites them:" >&2
  printf '  %s\n' "${differ[@]}" >&2
  exit 1
fi
echo "format: all ${#files[@]} files match clang-format"
