#!/usr/bin/env bash
# Builds the JavaScript example agent: OUT_DIR/agent-js.wasm (componentize-js).
# Skips the build when the output is newer than agent.js, this script, the
# package files and the WIT. componentize-js comes from node_modules here
# (npm ci, done by scripts/toolchains).
#
# Of componentize-js's WASI features only `stdio` is kept (uncaught errors
# are printed to stderr); http and fetch-event would import wasi:http, which
# the host does not provide, and clocks/random are not needed by the agent.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 OUT_DIR" >&2; exit 2; }
mkdir -p "$1"
out_dir=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$here"
out=$out_dir/agent-js.wasm

say() { printf 'agent-js: %s\n' "$*" >&2; }

command -v node >/dev/null || { say "node not found: install Node.js >= 18 (Debian: apt-get install nodejs npm)"; exit 1; }
cli=node_modules/@bytecodealliance/componentize-js/src/cli.js
[ -f "$cli" ] || { say "componentize-js not found in plugins/agent-js/node_modules: run scripts/toolchains (or npm ci here)"; exit 1; }

sources=(agent.js build.sh package.json package-lock.json "$root/templates/js/helpers.js" "$root/wit")
if [ -f "$out" ] && [ -z "$(find "${sources[@]}" -newer "$out" -print -quit)" ]; then
  say "up to date: $out"
  exit 0
fi

stage=$root/target/plugins-build/agent-js
mkdir -p "$stage"
rm -f "$stage/agent-js.wasm"
say "building $out"
# One module: the helpers, then the agent without its import of them.
{ cat "$root/templates/js/helpers.js"; grep -v "from './helpers.js'" agent.js; } > "$stage/bundle.js"
node "$cli" --wit "$root/wit" --world-name turn \
  --disable random clocks http fetch-event \
  -o "$stage/agent-js.wasm" "$stage/bundle.js"
# componentize-js's CLI does not always exit non-zero on failure: check.
[ -s "$stage/agent-js.wasm" ] || { say "componentize-js produced no output"; exit 1; }
mv -f "$stage/agent-js.wasm" "$out"
