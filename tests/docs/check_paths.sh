#!/usr/bin/env bash
# Every repository path that README.md, CONTRIBUTING.md and docs/*.md name in backticks
# exists: a doc that points at a moved or deleted file fails here, with its file:line.
# Paths start with a top-level folder of the repository; a path without its extension
# (a test binary, a source stem) names its source file. Patterns (*, <…>, {…}),
# placeholders (PAPER/TABLE) and paths under a run's home (runs/, data/) are not checked.
set -euo pipefail
root="${1:-$(cd "$(dirname "$0")/../.." && pwd)}"
cd "$root"
tops="$(find . -maxdepth 1 -mindepth 1 -type d ! -name '.git' ! -name 'build*' ! -name 'data' ! -name 'runs' -printf '%f|' | sed 's/|$//')"
missing=0
checked=0
for doc in README.md CONTRIBUTING.md docs/*.md; do
  [ -f "$doc" ] || continue
  while IFS= read -r hit; do
    line="${hit%%:*}"
    path="${hit#*:}"
    path="${path%%:*}"          # file:line references name the file
    path="${path%%#*}"          # anchors
    path="${path%[.,;)]}"
    case "$path" in *'*'*|*'<'*|*'{'*|*'['*|*'$'*|*'…'*) continue ;; esac
    # PAPER/TABLE and the like are placeholders, not paths.
    if [[ "$path" =~ /[A-Z][A-Z_]+(/|\.|$) ]]; then continue; fi
    checked=$((checked + 1))
    # A name without its extension (a test binary, a source stem) is its source file.
    if [ ! -e "$path" ] && ! compgen -G "$path.*" >/dev/null; then
      echo "$doc:$line: names \`$path\`, which the repository does not have"
      missing=$((missing + 1))
    fi
  done < <(grep -noE "\`(${tops})/[A-Za-z0-9_./*<>{}$…-]*\`" "$doc" | sed -E 's/`//g')
done
echo "docs: $checked paths checked, $missing missing"
[ "$missing" -eq 0 ]
