#!/usr/bin/env bash
# The flake hunt: scripts/test.sh run N times back to back on this machine, each run's log
# kept, and one table row per run (wall time, passed, failed, the failed tests). With
# --hog K, K busy loops run beside every run (a 2-core machine at half its speed): the
# deadlines of the tests are then tested too.
#
#     scripts/repeat_tests.sh [--runs 5] [--hog-run 5] [--hog 2] [--logs DIR]
#
# --hog-run I puts the busy loops beside run I only (default: none; --hog alone: all).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

runs=5 hog=0 hog_run=0 logs=
while [ "$#" -gt 0 ]; do
    case "$1" in
        --runs) runs=$2; shift 2 ;;
        --hog) hog=$2; shift 2 ;;
        --hog-run) hog_run=$2; shift 2 ;;
        --logs) logs=$2; shift 2 ;;
        *) echo "repeat_tests.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
[ "$hog_run" -gt 0 ] && [ "$hog" -eq 0 ] && hog=2
logs=${logs:-$(mktemp -d /tmp/omni-test-runs.XXXXXX)}
mkdir -p "$logs"
hogs=()
stop_hogs() { [ "${#hogs[@]}" -gt 0 ] && kill "${hogs[@]}" 2>/dev/null; hogs=(); }
trap stop_hogs EXIT

echo "| run | commit | CPU hog | wall | passed | failed | failed tests |"
echo "|---|---|---|---|---|---|---|"
for run in $(seq 1 "$runs"); do
    loaded=no
    if [ "$hog" -gt 0 ] && { [ "$hog_run" -eq 0 ] || [ "$hog_run" -eq "$run" ]; }; then
        for _ in $(seq 1 "$hog"); do
            python3 -c 'while True: pass' &
            hogs+=($!)
        done
        loaded="$hog busy loops"
    fi
    log=$logs/run-$run.log
    start=$(date +%s)
    scripts/test.sh >"$log" 2>&1
    rc=$?
    wall=$(($(date +%s) - start))
    stop_hogs
    # Both pytest sessions end with a summary line ("== 3 failed, 500 passed in 9.1s ==").
    passed=$(grep -E '^=+ .*(passed|failed).* in [0-9.]+s' "$log" | grep -oE '[0-9]+ passed' \
        | awk '{s += $1} END {print s + 0}')
    failed=$(grep -E '^=+ .*(passed|failed).* in [0-9.]+s' "$log" \
        | grep -oE '[0-9]+ (failed|error)' | awk '{s += $1} END {print s + 0}')
    names=$(grep -E '^(FAILED|ERROR) ' "$log" | awk '{print $2}' | paste -sd ' ' -)
    [ "$rc" -ne 0 ] && [ -z "$names" ] && names="exit $rc before pytest: see $log"
    printf '| %s | %s | %s | %dm%02ds | %s | %s | %s |\n' "$run" "$(git rev-parse --short HEAD)" \
        "$loaded" $((wall / 60)) $((wall % 60)) "$passed" "$failed" "${names:--}"
done
echo "logs in $logs"
