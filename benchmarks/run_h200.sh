#!/usr/bin/env bash
# One device call: install against the machine's torch/triton/transformers, run the GPU tests and
# the benchmarks named on the command line, and pack every log into $OUT/results.tgz.
#   bash benchmarks/run_h200.sh tests 120 "tests/test_x.py" bench 300 "benchmarks/bench_a.py" ...
# Kinds: tests (pytest -m cuda on the files), bench (python3 on the script and its arguments),
# cmd (any shell command, e.g. "compute-sanitizer --tool memcheck python3 x.py").
# Each step has its own timeout so one hang cannot eat the whole call; each step sees OUT set to
# the log folder, so the JSON/markdown files the benchmarks write travel in the same archive.
set -u
export PYTHONUNBUFFERED=1
LOG="${OUT:-/tmp/out}/r"
mkdir -p "$LOG"
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$LOG/install.log" 2>&1 \
  || { echo "install failed"; tail -20 "$LOG/install.log"; exit 1; }
python3 -m oxygen_torch doctor >"$LOG/doctor.txt" 2>&1
echo "doctor rc=$?"
step=0
while [ $# -ge 3 ]; do
  kind=$1; secs=$2; what=$3; shift 3
  step=$((step + 1))
  name="$LOG/$(printf %02d $step)_$(echo "$what" | tr -c 'A-Za-z0-9._-' '_' | cut -c1-60).log"
  start=$(date +%s)
  if [ "$kind" = tests ]; then  # GPU machine: only the cuda-marked tests (CPU ones run in CI)
    OUT="$LOG" timeout "$secs" python3 -m pytest -q -p no:cacheprovider -rs -m cuda $what >"$name" 2>&1
  elif [ "$kind" = cmd ]; then
    OUT="$LOG" timeout "$secs" bash -c "$what" >"$name" 2>&1
  else
    OUT="$LOG" timeout "$secs" python3 $what >"$name" 2>&1
  fi
  rc=$?
  echo "== [$kind] $what: rc=$rc in $(( $(date +%s) - start ))s"
  tail -n 25 "$name"
done
tar -C "${OUT:-/tmp/out}" -czf "${OUT:-/tmp/out}/results.tgz" r && rm -rf "$LOG"
