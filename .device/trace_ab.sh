#!/bin/bash
# The loaded trace (WFQ, 600 requests at 100 a second, cv 4, seed 0) once per setting, each its
# own process, logs and JSON under $OUT/<setting>. A setting: an OXYGEN_CONF string, "default"
# (none), or "settle" (the default with .device/exp_settle.patch applied for that run only).
#   bash .device/trace_ab.sh default kv.prefill_compile:false scheduler.stream_interval_ms:20
# Run through benchmarks/run_h200.sh's cmd kind (it installs first and sets $OUT):
#   bash benchmarks/run_h200.sh cmd 560 "bash .device/trace_ab.sh default kv.prefill_compile:false"
# TRACE_AB_MODES (default oxygen_wfq) and TRACE_AB_ARGS (e.g. --engine-clock) change every run.
set -u
: "${OUT:=/tmp/out}"
SECS=${TRACE_AB_SECS:-180}
for c in "$@"; do
    dir="$OUT/$(printf %s "$c" | tr -c 'A-Za-z0-9._-' '_')"
    mkdir -p "$dir"
    conf=$c; [ "$c" = default ] || [ "$c" = settle ] && conf=""
    [ "$c" = settle ] && patch -s -p1 < .device/exp_settle.patch
    start=$(date +%s)
    OUT=$dir OXYGEN_CONF=$conf timeout "$SECS" python3 benchmarks/bench_multitask.py \
        --modes ${TRACE_AB_MODES:-oxygen_wfq} --seeds 0 --cvs 4 --requests 600 --rate 100 \
        ${TRACE_AB_ARGS:-} > "$dir/run.log" 2>&1
    echo "== $c: rc=$? in $(( $(date +%s) - start ))s"
    [ "$c" = settle ] && patch -s -R -p1 < .device/exp_settle.patch
    grep -E "^\| (oxygen_|high_only)" "$dir/run.log" || tail -n 5 "$dir/run.log"
done
