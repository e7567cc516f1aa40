# check.sh - what the shell tests share (sourced by tests/test_cli.sh and
# tests/test_build.sh): pass, fail and skip print one line per check ("PASS name",
# "FAIL name: why", "SKIP name: why") and count it; finish prints the closing line that
# scripts/run-tests.sh sums, "N passed, N failed, N skipped", and exits 1 when any failed.
passed=0 failed=0 skipped=0

pass() { echo "PASS $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1: $2"; failed=$((failed + 1)); }
skip() { echo "SKIP $1: $2"; skipped=$((skipped + 1)); }
finish() {
    echo "$passed passed, $failed failed, $skipped skipped"
    [ "$failed" -eq 0 ]
    exit $?
}
