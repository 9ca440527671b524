#!/usr/bin/env bash
# scripts/check-links passes on the tree (README.md, BENCHMARKS.md, docs/), and fails naming the
# file, line and link when a copy of the tree links a guide that is not there or a heading that
# is not in its file.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$root/scripts/check-links" --root "$root"
cp -r "$root/README.md" "$root/BENCHMARKS.md" "$root/docs" "$root/examples" "$work/"
echo 'See [the guide](docs/guide/nowhere.md) and [its part](docs/guide/train.md#no-such-part).' \
  >> "$work/README.md"
line=$(wc -l < "$work/README.md")
if out=$("$root/scripts/check-links" --root "$work" 2>&1); then
  echo "FAIL: a broken link passed the link check"; exit 1
fi
for expected in \
    "README.md:$line: link to docs/guide/nowhere.md: no such file" \
    "README.md:$line: link to docs/guide/train.md#no-such-part: docs/guide/train.md has no heading #no-such-part" \
    "2 link(s) that do not resolve"; do
  if [[ $out != *"$expected"* ]]; then
    echo "FAIL: the link check did not say: $expected"; echo "$out"; exit 1
  fi
done
echo "check-links: passes the tree, refuses a missing guide and a missing heading"
