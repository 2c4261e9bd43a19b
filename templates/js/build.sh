#!/usr/bin/env bash
# Builds {{name}}.wasm with componentize-js 0.23.0 (npm install fetches it;
# LEASEHOLD_NODE_MODULES may name a node_modules that already holds it).
set -euo pipefail
cd "$(dirname "$0")"
command -v node >/dev/null || { echo "build: node not found: install Node.js 18 or later" >&2; exit 1; }
cli=node_modules/@bytecodealliance/componentize-js/src/cli.js
if [ ! -f "$cli" ] && [ -n "${LEASEHOLD_NODE_MODULES:-}" ]; then
  cli=$LEASEHOLD_NODE_MODULES/@bytecodealliance/componentize-js/src/cli.js
fi
[ -f "$cli" ] || npm install --no-audit --no-fund --silent
# One module: the helpers, then the turn without its import of them.
mkdir -p target
{ cat helpers.js; grep -v "from './helpers.js'" app.js; } > target/bundle.js
# Only stdio of componentize-js's WASI features is kept (an uncaught error
# is printed to stderr, which the host keeps for the run's error).
node "$cli" --wit wit --world-name turn --disable random clocks http fetch-event -o {{name}}.wasm target/bundle.js >/dev/null
[ -s {{name}}.wasm ] || { echo "build: componentize-js produced no output" >&2; exit 1; }
echo "built {{name}}.wasm ($(stat -c %s {{name}}.wasm) bytes)"
