#!/usr/bin/env bash
# check_paths.sh can fail: in a scratch tree whose doc names one file it has and one it
# lacks, it exits non-zero and names the missing one with its file:line.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
d="$(mktemp -d)"
trap 'rm -rf "$d"' EXIT
mkdir -p "$d/docs" "$d/cli"
touch "$d/cli/here.cpp"
printf 'see `cli/here.cpp` and `cli/gone.cpp`\n' > "$d/docs/x.md"
out="$(bash "$here/check_paths.sh" "$d")"
rc=$?
echo "$out"
[ "$rc" -ne 0 ] || { echo "expected a failure"; exit 1; }
grep -qF 'docs/x.md:1: names `cli/gone.cpp`, which the repository does not have' <<< "$out" || exit 1
grep -qF 'docs: 2 paths checked, 1 missing' <<< "$out"
