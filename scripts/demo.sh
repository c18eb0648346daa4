#!/usr/bin/env bash
# The local stack, step one: build the tiny model, start a generator, sample from it, stop it.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
RUN="runs/demo-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$RUN"
ln -sfn "$(basename "$RUN")" runs/latest

[ -f runs/models/tiny/config.json ] || $BIN/rollwire model tiny runs/models/tiny
$BIN/rollwire generator --model runs/models/tiny --port 0 --metrics-port 0 --ready-file "$RUN/generator.ready" \
  >"$RUN/generator.log" 2>&1 &
GEN=$!
trap 'kill $GEN 2>/dev/null; wait $GEN 2>/dev/null || true' EXIT INT TERM
for _ in $(seq 600); do [ -f "$RUN/generator.ready" ] && break; kill -0 $GEN || { cat "$RUN/generator.log"; exit 1; }; sleep 0.1; done
PORT=$($BIN/python -c "import json,sys; print(json.load(open(sys.argv[1]))['port'])" "$RUN/generator.ready")
echo "generator on 127.0.0.1:$PORT (log: $RUN/generator.log)"
$BIN/rollwire status --target "127.0.0.1:$PORT"
$BIN/rollwire generate --target "127.0.0.1:$PORT" -n 4 --max-new-tokens 24 --seed 1 "12+34="
echo "run folder: $RUN"
