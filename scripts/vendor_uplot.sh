#!/usr/bin/env bash
# Fetches uPlot from the npm registry and copies the files that `oomkit report`
# embeds into crates/oomkit-report/assets/vendor/uplot. npm checks the
# tarball against the registry's integrity hash as it packs it.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/vendor_uplot.sh VERSION (for example 1.6.32)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "uplot@$version" >/dev/null && tar xzf "uplot-$version.tgz")
dest=crates/oomkit-report/assets/vendor/uplot
cp "$work/package/dist/uPlot.iife.min.js" "$work/package/dist/uPlot.min.css" "$work/package/LICENSE" "$dest/"
echo "vendored uPlot $version: $(npm view "uplot@$version" dist.integrity 2>/dev/null)"
echo "update the version and integrity in $dest/README.md and in crates/oomkit-report/assets/report.html"
