#!/usr/bin/env bash
# Builds the Python example agent: OUT_DIR/agent-py.wasm (componentize-py).
# Skips the build when the output is newer than app.py, this script, the WIT
# and componentize-py itself. The toolchain comes from scripts/toolchains
# (target/toolchains/py); a componentize-py on PATH is used otherwise.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 OUT_DIR" >&2; exit 2; }
mkdir -p "$1"
out_dir=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$here"
out=$out_dir/agent-py.wasm

say() { printf 'agent-py: %s\n' "$*" >&2; }

cpy=$root/target/toolchains/py/bin/componentize-py
if [ ! -x "$cpy" ]; then
  cpy=$(command -v componentize-py || true)
  [ -n "$cpy" ] || { say "componentize-py not found: run scripts/toolchains (installs it into target/toolchains/py)"; exit 1; }
fi

sources=(app.py build.sh "$root/templates/python/helpers.py" "$root/wit" "$cpy")
if [ -f "$out" ] && [ -z "$(find -L "${sources[@]}" -newer "$out" -print -quit)" ]; then
  say "up to date: $out"
  exit 0
fi

# Real WASI, as every other guest gets it: the host provides all of WASI
# p2 deny-by-default (no files, no network, no environment, virtual clocks,
# seeded random), and the guest's stderr goes to a capped buffer, so an
# uncaught exception's traceback ends up in the run's error.
#
# Build from a staging copy so only app.py and helpers.py are bundled (componentize-py
# bundles its whole python path) and no __pycache__ lands in the tree.
stage=$root/target/plugins-build/agent-py
rm -rf "$stage"
mkdir -p "$stage/src"
cp app.py "$root/templates/python/helpers.py" "$stage/src/"
say "building $out"
(cd "$stage" && env -u VIRTUAL_ENV PYTHONDONTWRITEBYTECODE=1 \
  "$cpy" --quiet -d "$root/wit" -w turn componentize -p "$stage/src" app -o "$stage/agent-py.wasm")
mv -f "$stage/agent-py.wasm" "$out"
