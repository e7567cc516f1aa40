#!/usr/bin/env bash
# run-tests.sh - what `make test` runs: the C tests (build/comet_tests), the tool's
# command-line checks (tests/test_cli.sh), the build's choices (tests/test_build.sh: which
# NCCL, what `make` builds), then the Python package's CPU tests (python/tests/run_cpu.py;
# tests that need torch or GPUs print SKIP), and one closing line with the sums of all
# four: "N passed, N failed, N skipped". Each runner's own closing line is shown as
# "[c] ...", "[cli] ...", "[build] ..." and "[python] ...". Exit status 1 when anything
# failed, or a runner ended without its closing line.
# Usage: scripts/run-tests.sh [ARGS...]   (ARGS go to the C runner: -v, name substrings)
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
passed=0 failed=0 skipped=0 status=0
total='^([0-9]+) passed, ([0-9]+) failed, ([0-9]+) skipped$'

run() { # run LABEL COMMAND...: run it, show its output, add its closing line to the sums
    local label=$1 log rc last
    shift
    log=$(mktemp)
    "$@" 2>&1 | tee "$log" | sed -E "s/$total/[$label] &/"
    rc=${PIPESTATUS[0]}
    last=$(grep -E "$total" "$log" | tail -n 1)
    rm -f "$log"
    if [[ ! $last =~ $total ]]; then
        echo "FAIL $label tests: the runner ended (exit code $rc) without its closing line"
        failed=$((failed + 1)) status=1
        return
    fi
    passed=$((passed + BASH_REMATCH[1])) failed=$((failed + BASH_REMATCH[2])) skipped=$((skipped + BASH_REMATCH[3]))
    if [ "$rc" -ne 0 ]; then status=1; fi
}

run c build/comet_tests "$@"
run cli tests/test_cli.sh build/comet
run build tests/test_build.sh
if command -v "$python" >/dev/null 2>&1; then
    run python "$python" python/tests/run_cpu.py
else
    echo "SKIP python tests: $python not found"
    skipped=$((skipped + 1))
fi
echo "$passed passed, $failed failed, $skipped skipped"
if [ "$failed" -ne 0 ]; then status=1; fi
exit $status
