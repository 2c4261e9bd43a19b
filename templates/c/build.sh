#!/usr/bin/env bash
# Builds {{name}}.wasm: wit-bindgen c, then clang-16 for wasm32-wasi
# (Debian's clang-16, lld-16, wasi-libc, libclang-rt-16-dev-wasm32), then
# wasm-tools component new. wit-bindgen 0.57.1 and wasm-tools come from
# crates.io (cargo install --locked wit-bindgen-cli@0.57.1 wasm-tools).
set -euo pipefail
cd "$(dirname "$0")"
export PATH="$HOME/.cargo/bin:$PATH"
for tool in clang-16 wit-bindgen wasm-tools; do
  command -v "$tool" >/dev/null || { echo "build: $tool not found (see the top of build.sh)" >&2; exit 1; }
done
rm -rf target/gen && mkdir -p target/gen
wit-bindgen c wit --world turn --out-dir target/gen >/dev/null
clang-16 --target=wasm32-wasi -mexec-model=reactor -std=c11 -Os -Wall -Wextra -I target/gen \
  turn.c target/gen/turn.c target/gen/turn_component_type.o -Wl,--strip-debug -o target/{{name}}.core.wasm
wasm-tools component new target/{{name}}.core.wasm -o {{name}}.wasm
wasm-tools validate {{name}}.wasm
echo "built {{name}}.wasm ($(stat -c %s {{name}}.wasm) bytes)"
