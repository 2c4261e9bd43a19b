#!/usr/bin/env bash
# Builds {{name}}.wasm with componentize-py 0.25.1: from PATH, or from
# $LEASEHOLD_TOOLCHAINS/py/bin (leasehold's scripts/toolchains puts it in
# target/toolchains), or: python3 -m venv .venv && .venv/bin/pip install componentize-py==0.25.1
set -euo pipefail
cd "$(dirname "$0")"
cpy=""
for c in "$(command -v componentize-py || true)" "${LEASEHOLD_TOOLCHAINS:-/nonexistent}/py/bin/componentize-py" .venv/bin/componentize-py; do
  if [ -n "$c" ] && [ -x "$c" ]; then cpy=$c; break; fi
done
[ -n "$cpy" ] || { echo "build: componentize-py not found (see the top of build.sh)" >&2; exit 1; }
# Only the sources are bundled (componentize-py bundles its whole path).
rm -rf target/src && mkdir -p target/src && cp app.py helpers.py target/src/
env -u VIRTUAL_ENV PYTHONDONTWRITEBYTECODE=1 "$cpy" --quiet -d wit -w turn componentize -p target/src app -o {{name}}.wasm
echo "built {{name}}.wasm ($(stat -c %s {{name}}.wasm) bytes)"
