#!/bin/bash
# The whole `cuda` suite on a device machine, longer than one call: started in the background in
# a copy of the tree (so later syncs of the tree do not change it mid-run), in its own process
# session (it survives the call), then waited for by later calls made within the machine's idle
# release (30 s): keep the calls back to back.
#   bash .device/gpu_suite.sh start fwd|rev [GPU]  # rev: pytest --reverse (tests/conftest.py)
#   bash .device/gpu_suite.sh start par [N]        # N pytest-xdist workers on the one GPU, a
#       file to a worker (--dist loadfile); the wheels from .whl/ (carry it) when not installed
#   bash .device/gpu_suite.sh wait fwd|rev SECS    # log copied to $OUT/suite_<order>.log
# GPU: the index the run sees as its only device (CUDA_VISIBLE_DEVICES): on a machine of two
# GPUs both orders run at once (`start rev 0; start fwd 1`), ~13 minutes instead of ~20.
set -u
cmd=$1 o=$2
case $cmd in
start)
    # the tree as carried has no oxygen_torch.triton_kernels (setup.py maps triton_kernels/
    # there) and no built library: install it first, as run_h200.sh does
    python3 -c "import oxygen_torch.triton_kernels" 2>/dev/null \
        || python3 -m pip install -q --no-build-isolation --no-deps -e . >/root/suite_install.log 2>&1 \
        || { echo "install failed"; tail -20 /root/suite_install.log; exit 1; }
    extra=""; [ "$o" = rev ] && extra="--reverse"
    vis=""; [ -n "${3:-}" ] && [ "$o" != par ] && vis="CUDA_VISIBLE_DEVICES=$3"
    if [ "$o" = par ]; then
        python3 -c "import xdist" 2>/dev/null \
            || python3 -m pip install -q --no-deps .whl/execnet-*.whl .whl/pytest_xdist-*.whl \
            || { echo "no pytest-xdist: carry .whl with its wheel"; exit 1; }
        extra="-n ${3:-3} --dist loadfile"
    fi
    rm -rf "/root/st_$o" "/root/suite_$o.rc"; cp -a . "/root/st_$o"; cd "/root/st_$o" || exit 1
    setsid nohup bash -c "$vis timeout 1500 python3 -m pytest -m cuda -p no:cacheprovider -q -rs --durations=30 --junitxml=/root/suite_$o.xml $extra tests > /root/suite_$o.log 2>&1; echo \$? > /root/suite_$o.rc" >/dev/null 2>&1 < /dev/null &
    echo "started $o" ;;
wait)
    t=0
    while [ ! -f "/root/suite_$o.rc" ] && [ "$t" -lt "$3" ]; do sleep 5; t=$((t + 5)); done
    cp "/root/suite_$o.log" "$OUT/suite_$o.log" 2>/dev/null
    cp "/root/suite_$o.xml" "$OUT/suite_$o.xml" 2>/dev/null
    echo "rc: $(cat "/root/suite_$o.rc" 2>/dev/null || echo running)"; tail -c 6000 "/root/suite_$o.log" ;;
esac
