#!/usr/bin/env bash
# Builds the C example agent: OUT_DIR/agent-c.wasm.
#
#   wit-bindgen c  -> target/plugins-build/agent-c/gen/{turn.h,turn.c,turn_component_type.o}
#   clang-16 (wasm32-wasi, reactor, Debian's wasi-libc) -> a core module
#   wasm-tools component new -> the component
#
# agent.c uses no stdio, clocks or randomness, so the core module imports
# nothing from WASI and needs no preview1 adapter; the build checks that.
# Skips the build when the output is newer than agent.c, this script and the
# WIT. Tools come from scripts/toolchains.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 OUT_DIR" >&2; exit 2; }
mkdir -p "$1"
out_dir=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$here"
export PATH="$HOME/.cargo/bin:$PATH"
out=$out_dir/agent-c.wasm

say() { printf 'agent-c: %s\n' "$*" >&2; }
need() { command -v "$1" >/dev/null || { say "$1 not found: $2 (scripts/toolchains installs it)"; exit 1; }; }

need clang-16 "install the Debian package clang-16"
need wasm-ld-16 "install the Debian package lld-16"
need wit-bindgen "cargo install --locked wit-bindgen-cli@0.57.1"
need wasm-tools "cargo install --locked wasm-tools"
CC=(clang-16 --target=wasm32-wasi)
[ -f "$("${CC[@]}" -print-file-name=libc.a)" ] \
  || { say "wasi-libc not found (no libc.a for wasm32-wasi): install the Debian package wasi-libc (scripts/toolchains installs it)"; exit 1; }
[ -f "$("${CC[@]}" -print-libgcc-file-name)" ] \
  || { say "the wasm32 compiler-rt builtins are missing: install the Debian package libclang-rt-16-dev-wasm32 (scripts/toolchains installs it)"; exit 1; }

sources=(agent.c build.sh "$root/wit" "$root/templates/c/leasehold.h")
if [ -f "$out" ] && [ -z "$(find "${sources[@]}" -newer "$out" -print -quit)" ]; then
  say "up to date: $out"
  exit 0
fi

build=$root/target/plugins-build/agent-c
rm -rf "$build"
mkdir -p "$build/gen"
say "building $out"
if ! wit-bindgen c "$root/wit" --world turn --out-dir "$build/gen" >"$build/wit-bindgen.log" 2>&1; then
  cat "$build/wit-bindgen.log" >&2
  say "wit-bindgen c failed"
  exit 1
fi
"${CC[@]}" -mexec-model=reactor -std=c11 -Os -Wall -Wextra \
  -I "$build/gen" -I "$root/templates/c" \
  agent.c "$build/gen/turn.c" "$build/gen/turn_component_type.o" \
  -Wl,--strip-debug \
  -o "$build/agent-c.core.wasm"
if wasm-tools print "$build/agent-c.core.wasm" | grep -q '(import "wasi_snapshot_preview1"'; then
  say "the core module imports WASI preview1 functions (see wasm-tools print $build/agent-c.core.wasm):"
  say "keep stdio, clocks and other WASI calls out of agent.c, or link with a preview1 reactor adapter"
  exit 1
fi
wasm-tools component new "$build/agent-c.core.wasm" -o "$build/agent-c.wasm"
wasm-tools validate "$build/agent-c.wasm"
mv -f "$build/agent-c.wasm" "$out"
