#!/usr/bin/env bash
# Issue 35: the anchor workload (bench_allocator.py --anchor --calls N) under expandable segments
# and the pool at several pool.hysteresis_ms, each in its own process; then the modes in
# $SPY_MODES (default: the pool at 20 ms) again under py-spy --native at $SPY_RATE a second
# (default 20: at 100 native sampling fell 5 s behind on an H100 host), raw samples to $OUT (where
# the pool's extra seconds go).
#   OUT=... [ANCHORS="expandable default"] bash .device/alloc_profile.sh [calls] [hysteresis ms ...]
set -u
OUT="${OUT:-/tmp/out}"
CALLS="${1:-7}"; shift || true
HYST="${*:-200}"
W="import sys, json; sys.path.insert(0, 'benchmarks'); import workloads as w; print(json.dumps(w.run(sys.argv[1], $CALLS, None)))"
for a in ${ANCHORS:-expandable}; do  # ANCHORS="expandable default": the caching allocator too
  python3 -c "$W" "$a" >"$OUT/alloc_$a.json" 2>"$OUT/alloc_$a.err"
  echo "$a: $(tail -1 "$OUT/alloc_$a.json")"
done
for h in $HYST; do
  OXYGEN_HYSTERESIS_MS=$h python3 -c "$W" oxygen >"$OUT/alloc_oxygen_h$h.json" 2>"$OUT/alloc_oxygen_h$h.err"
  echo "oxygen h=$h: $(tail -1 "$OUT/alloc_oxygen_h$h.json")"
done
SPY=$(command -v py-spy || true)
if [ -z "$SPY" ]; then
  python3 -m pip install -q --no-deps .whl/py_spy-*.whl >/dev/null 2>&1
  SPY=$(command -v py-spy || true)
fi
[ -n "$SPY" ] || { echo "no py-spy"; exit 0; }
for mode in ${SPY_MODES:-oxygen}; do
  "$SPY" record --native --rate ${SPY_RATE:-20} --format raw -o "$OUT/alloc_${mode}_pyspy.txt" -- \
    python3 -c "$W" "$mode" >"$OUT/alloc_${mode}_spied.json" 2>"$OUT/alloc_${mode}_spied.err"
  echo "spied $mode (pool.hysteresis_ms default): $(tail -1 "$OUT/alloc_${mode}_spied.json")"
done
