#!/usr/bin/env bash
# Refresh the copy of MathJax 3 that the book serves itself (book/_static/mathjax/), so that
# math typesets without a CDN: offline, behind a firewall, or on a closed network.
# Usage: tools/vendor_mathjax.sh [VERSION]   (default 3.2.2; needs npm and the npm registry)
set -euo pipefail

version="${1:-3.2.2}"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="$repo_root/book/_static/mathjax"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

(cd "$scratch" && npm pack --silent "mathjax@$version" >/dev/null && tar -xzf mathjax-*.tgz)
es5="$scratch/package/es5"

rm -rf "$target"
mkdir -p "$target/output/chtml/fonts" "$target/input/tex"
# The TeX-to-HTML component the pages load, the web fonts its output uses, and the TeX
# extensions it loads on demand (\color, \cancel, \bbox, ...): nothing else is fetched.
cp "$es5/tex-chtml.js" "$target/"
cp -r "$es5/output/chtml/fonts/woff-v2" "$target/output/chtml/fonts/"
cp -r "$es5/input/tex/extensions" "$target/input/tex/"
cp "$scratch/package/LICENSE" "$target/LICENSE"
echo "$version" > "$target/VERSION"
echo "MathJax $version in ${target#"$repo_root"/}: $(du -sh "$target" | cut -f1)"
