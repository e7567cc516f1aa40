#!/usr/bin/env bash
# run-tests.sh - what `make test` runs: the tree's layout rules (scripts/check-tree.py), the
# C tests (build/comet_tests), the tool's command-line checks (tests/test_cli.sh), the
# build's choices (tests/test_build.sh: which NCCL, what `make` builds, ptxas's notes on
# the FP8 GEMM), then the Python
# package's CPU tests (python/tests: `pytest python/tests` where pytest is installed, else
# python/tests/run_cpu.py, which runs the same test functions; tests that need torch or
# GPUs skip, saying why), and one closing line with the sums of all five: "N passed,
# N failed, N skipped". Each runner's own closing line is shown as "[tree] ...", "[c] ...",
# "[cli] ...", "[build] ..." and "[python] ..." (pytest's summary translated into that
# form, its errors counted as failures). Exit status 1 when anything failed, or a runner
# ended without its closing line.
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

python_tests() { # the Python CPU tests, ending with the closing line
    if ! "$python" -c 'import pytest' >/dev/null 2>&1; then
        echo "(pytest is not installed: python/tests/run_cpu.py runs the tests)"
        "$python" python/tests/run_cpu.py
        return
    fi
    local log rc line n p=0 f=0 s=0
    log=$(mktemp)
    "$python" -m pytest python/tests -rs -p no:cacheprovider 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    line=$(grep -E '^=+ .* in [0-9.]+s' "$log" | tail -n 1)  # "== 40 passed, 5 skipped in 3.2s =="
    rm -f "$log"
    for n in passed failed skipped error errors; do
        if [[ $line =~ ([0-9]+)\ $n[,\ ] ]]; then
            case $n in passed) p=${BASH_REMATCH[1]} ;; skipped) s=${BASH_REMATCH[1]} ;;
                *) f=$((f + BASH_REMATCH[1])) ;; esac
        fi
    done
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi  # stopped before counting (pytest.exit), or no tests
    echo "$p passed, $f failed, $s skipped"
    return "$rc"
}

if command -v "$python" >/dev/null 2>&1; then
    run tree "$python" scripts/check-tree.py
fi
run c build/comet_tests "$@"
run cli tests/test_cli.sh build/comet
run build tests/test_build.sh
if command -v "$python" >/dev/null 2>&1; then
    run python python_tests
else
    echo "SKIP python tests: $python not found"
    skipped=$((skipped + 1))
fi
echo "$passed passed, $failed failed, $skipped skipped"
if [ "$failed" -ne 0 ]; then status=1; fi
exit $status
