#!/usr/bin/env bash
# The whole suite (or the pytest arguments given) several times in a row, to find flaky tests.
#
#   bash scripts/repeat.sh 5                      # 5 runs back to back
#   bash scripts/repeat.sh 2 --load               # 2 runs, each beside a CPU hog per core
#   bash scripts/repeat.sh 20 tests/test_warm.py  # one file, 20 times
#
# Each run's summary line and failed tests go to the log (repeat-<time>.log, or $REPEAT_LOG),
# and the whole output of a failed run beside it (repeat-<time>-run<N>.txt);
# the last line says how many runs failed, and the exit status is 1 if any did. The hogs are
# ended by their own pids when the script ends, however it ends.
#
# Each run is parallel as in scripts/test.sh: TORCHRUNX_TEST_WORKERS pytest-xdist workers (default
# 4; 0: one process), --dist loadgroup.
#
# Each run has its own pytest base folder (under $REPEAT_BASETEMP, default a new folder in /tmp),
# not /tmp/pytest-of-$USER: another pytest session started meanwhile rotates that folder's
# numbered entries and may delete a running suite's (its test hosts' keys and sshd config).
# Run your own tests meanwhile with TMPDIR and --basetemp elsewhere too (CONTRIBUTING).
#
# REPEAT_LOCK=/tmp/trx-cluster.lock: each run holds that lock (flock) while it runs, so that
# other work that takes it (a test file with test hosts) waits for the run to end, and the
# run waits for it, rather than the two breaking each other's test hosts.
set -uo pipefail
cd "$(dirname "$0")/.."

runs=${1:?how many runs}
shift
load=0
if [[ "${1:-}" == "--load" ]]; then
    load=1
    shift
fi
python=.venv/bin/python
log=${REPEAT_LOG:-repeat-$(date +%Y%m%d-%H%M%S).log}
base=${REPEAT_BASETEMP:-$(mktemp -d /tmp/torchrunx-repeat.XXXXXX)}
mkdir -p "$base"
workers=${TORCHRUNX_TEST_WORKERS:-4}
parallel=()
if ((workers > 0)); then
    parallel=(-n "$workers" --dist loadgroup)
fi
runner=()
if [[ -n "${REPEAT_LOCK:-}" ]]; then
    runner=(flock "$REPEAT_LOCK")
fi
hogs=()
stop_hogs() {
    if ((${#hogs[@]})); then
        kill "${hogs[@]}" 2>/dev/null
        wait "${hogs[@]}" 2>/dev/null
    fi
    hogs=()
}
trap stop_hogs EXIT

echo "$(date -Is) commit $(git rev-parse --short HEAD), $runs runs, load=$load, workers=$workers, args: ${*:-the whole suite}" | tee -a "$log"
failed=0
for ((i = 1; i <= runs; i++)); do
    if ((load)); then
        for ((c = 0; c < $(nproc); c++)); do
            "$python" -c 'while True: pass' &
            hogs+=($!)
        done
    fi
    started=$(date +%s)
    out=$(mktemp)
    "${runner[@]}" "$python" -m pytest -q -p no:cacheprovider -rfE "${parallel[@]}" --basetemp "$base/run$i" "$@" >"$out" 2>&1
    code=$?
    stop_hogs
    summary=$(grep -E '^(FAILED|ERROR) |[0-9]+ (passed|failed)' "$out")
    if ((code == 0)); then
        rm -f "$out"
        rm -rf "$base/run$i"
    else  # the whole output of a failed run, tracebacks included, beside the log
        mv "$out" "${log%.log}-run$i.txt"
        summary+=$'\n'"(output: ${log%.log}-run$i.txt)"
    fi
    echo "run $i: exit $code in $(($(date +%s) - started)) s" | tee -a "$log"
    echo "$summary" | sed 's/^/    /' | tee -a "$log"
    ((code == 0)) || failed=$((failed + 1))
done
echo "$failed of $runs runs failed" | tee -a "$log"
((failed == 0))
