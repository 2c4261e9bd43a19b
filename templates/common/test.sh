#!/usr/bin/env bash
# Builds {{name}} and runs one turn of it with `leasehold run` (a throwaway
# SQLite database, the same worker code as `leasehold serve`) against a
# local HTTP server, then checks the turn's output. LEASEHOLD names the
# leasehold binary (default: the one on PATH).
set -euo pipefail
cd "$(dirname "$0")"
leasehold=${LEASEHOLD:-leasehold}
./build.sh
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkdir -p target/www
printf 'hello from the test server\n' > target/www/hello.txt
python3 -m http.server "$port" --bind 127.0.0.1 --directory target/www >/dev/null 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.05; done
input="{\"url\": \"http://127.0.0.1:$port/hello.txt\"}"
out=$("$leasehold" run {{name}}.wasm --input "$input" --http-allow "127.0.0.1:$port")
want='fetched 27 bytes (HTTP 200); visit 1'
if [ "$out" != "$want" ]; then
  echo "test: the turn returned \"$out\"; expected \"$want\"" >&2
  exit 1
fi
echo "test: ok: $out"
