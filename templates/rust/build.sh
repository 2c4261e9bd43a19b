#!/usr/bin/env bash
# Builds {{name}}.wasm (a component for wasm32-wasip2).
set -euo pipefail
cd "$(dirname "$0")"
export PATH="$HOME/.cargo/bin:$PATH"
rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2 || rustup target add wasm32-wasip2
cargo build --quiet --release --target wasm32-wasip2
# CARGO_TARGET_DIR, when set, shares compiled dependencies between projects.
cp "${CARGO_TARGET_DIR:-target}/wasm32-wasip2/release/{{crate}}.wasm" "{{name}}.wasm"
echo "built {{name}}.wasm ($(stat -c %s {{name}}.wasm) bytes)"
