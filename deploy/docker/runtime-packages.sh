#!/usr/bin/env bash
# Prints the Debian packages that hold the shared libraries the given binaries load, one a
# line, for the runtime stage of deploy/docker/Dockerfile (so that it installs exactly what
# the build links, and nothing of the build's -dev packages). A library no package holds
# (libcudart from a CUDA toolkit outside Debian) is copied into DIR with --copy-unowned DIR;
# without it, such a library is an error.
#
#   deploy/docker/runtime-packages.sh [--copy-unowned DIR] BINARY...
set -euo pipefail

copy_dir=""
if [[ "${1:-}" == "--copy-unowned" ]]; then
  copy_dir="$2"
  shift 2
fi
if (($# == 0)); then
  echo "usage: $0 [--copy-unowned DIR] BINARY..." >&2
  exit 2
fi

mapfile -t libraries < <(ldd "$@" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u)
# dpkg knows a library by the path it was installed at; /lib is a link to /usr/lib on
# Debian 12, so each library is looked up under every spelling, all in one dpkg-query.
declare -A spellings=()
for lib in "${libraries[@]}"; do
  real="$(readlink -f "$lib")"
  for path in "$lib" "$real" "${lib#/usr}" "/usr$lib" "${real#/usr}" "/usr$real"; do
    spellings["$path"]="$lib"
  done
done
declare -A owner_of=()
while IFS= read -r line; do
  # "package[:arch][, other]: /path" ("diversion by ..." lines name no owner)
  [[ "$line" == diversion* ]] && continue
  path="${line##*: }"
  owner="${line%%: *}"
  owner="${owner%%,*}"
  owner="${owner%%:*}"
  [[ -n "${spellings[$path]:-}" ]] && owner_of["${spellings[$path]}"]="$owner"
done < <(dpkg-query -S "${!spellings[@]}" 2>/dev/null || true)

declare -A packages=()
unowned=()
for lib in "${libraries[@]}"; do
  if [[ -n "${owner_of[$lib]:-}" ]]; then
    packages["${owner_of[$lib]}"]=1
  else
    unowned+=("$lib")
  fi
done

if ((${#unowned[@]})); then
  if [[ -z "$copy_dir" ]]; then
    echo "runtime-packages: no Debian package holds ${unowned[*]} (use --copy-unowned DIR)" >&2
    exit 1
  fi
  mkdir -p "$copy_dir"
  for lib in "${unowned[@]}"; do
    cp -L "$lib" "$copy_dir/"
    echo "runtime-packages: copied $lib into $copy_dir" >&2
  done
fi
printf '%s\n' "${!packages[@]}" | sort
