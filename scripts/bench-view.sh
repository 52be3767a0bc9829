#!/usr/bin/env bash
# The live view's cost: runs of the same job alternating without and with the page
# open in headless Chromium (polling once a second, in real time), and each run's
# median and mean step time (timing_s/step, first 2 steps left out).
#   scripts/bench-view.sh [CONFIG] [STEPS] [PAIRS]
# Needs target/release/yatt (or $YATT_BIN) and /usr/bin/chromium (or $YATT_CHROMIUM).
set -euo pipefail
CONFIG="${1:-config/demo-letters.toml}"
STEPS="${2:-40}"
PAIRS="${3:-3}"
YATT="${YATT_BIN:-target/release/yatt}"
CHROMIUM="${YATT_CHROMIUM:-/usr/bin/chromium}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
stats() {
  python3 - "$1" <<'PY'
import json, statistics, sys
xs = [json.loads(l).get("timing_s/step") for l in open(sys.argv[1]) if l.strip()][2:]
xs = [x for x in xs if x is not None]
print(f"{statistics.median(xs):.4f} {statistics.mean(xs):.4f} {len(xs)}")
PY
}
echo "| run | page | median step (s) | mean step (s) | steps |"
echo "|---|---|---|---|---|"
for i in $(seq 1 "$PAIRS"); do
  for page in off on; do
    out="$work/$i-$page"
    args=(train "$CONFIG" --set "job.steps=$STEPS" --set "job.output_dir=\"$out\"")
    [ "$page" = on ] && args+=(--http 0)
    RUST_LOG=warn "$YATT" "${args[@]}" >"$work/log" 2>&1 &
    train=$!
    browser=""
    if [ "$page" = on ]; then
      for _ in $(seq 1 300); do
        url="$(grep -o 'view: http://[^ ]*' "$work/log" | head -1 | cut -c7- || true)"
        [ -n "$url" ] && break
        sleep 0.1
      done
      [ -n "$url" ] || { echo "no URL printed" >&2; kill "$train"; exit 1; }
      "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
        --disable-background-networking --disable-component-update --disable-sync \
        --user-data-dir="$work/profile-$i" --remote-debugging-port=0 "$url" >/dev/null 2>&1 &
      browser=$!
    fi
    wait "$train"
    [ -n "$browser" ] && kill "$browser" 2>/dev/null && wait "$browser" 2>/dev/null || true
    read -r median mean n < <(stats "$out/metrics.jsonl")
    echo "| $i | $page | $median | $mean | $n |"
  done
done
