#!/usr/bin/env python3
"""run_cpu.py - the comet_moe package's CPU tests without pytest: every test_* function of
the test_*.py modules beside this file that need no GPU, in the order pytest runs them
(`pytest python/tests` runs the same functions, and is what `make test` uses where pytest
is installed). Tests that need torch or megatron-core run when they are installed (on the
CPU) and print SKIP with the reason otherwise.

Where libcomet is not built, the run fails once, saying so, instead of once per test.
Prints PASS/FAIL/SKIP per test, as tests/runner.c does, and ends with "N passed, N failed,
N skipped"; exit status 1 when anything failed. No install needed: python/ goes on
sys.path.

    python3 python/tests/run_cpu.py [-v] [SUBSTRING...]   (-v: print passing tests' notes)
"""
from __future__ import annotations

import importlib
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers  # noqa: E402 - puts the repository's python/ on sys.path

# The CPU test modules, in pytest's order (by name); test_torch_gpu.py's one test runs the
# GPU suite under torchrun, which this runner leaves to pytest and to torchrun itself.
MODULES = sorted(p.stem for p in Path(__file__).resolve().parent.glob("test_*.py") if p.stem != "test_torch_gpu")
TIMEOUT_S = 300


def collect():
    tests = []
    for name in MODULES:
        module = importlib.import_module(name)
        tests += [fn for key, fn in vars(module).items() if key.startswith("test_") and callable(fn)]
    return tests


def main(argv):
    verbose = "-v" in argv
    filters = [a for a in argv if a != "-v"]
    error = helpers.library_error()
    if error is not None:
        print(f"FAIL {error}")
        print("0 passed, 1 failed, 0 skipped")
        return 1
    passed = failed = skipped = 0

    def on_alarm(signum, frame):
        raise TimeoutError(f"timed out after {TIMEOUT_S} s")

    signal.signal(signal.SIGALRM, on_alarm)
    for fn in collect():
        name = f"{fn.__module__}.{fn.__name__}"
        if filters and not any(f in name for f in filters):
            continue
        helpers.NOTES.clear()
        start = time.monotonic()
        signal.alarm(TIMEOUT_S)
        try:
            fn()
        except helpers.Skip as e:
            print(f"SKIP {name}: {e}")
            skipped += 1
            continue
        except Exception as e:  # noqa: BLE001 - a test's failure of any kind is reported
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            for line in traceback.format_exc().rstrip().splitlines():
                print("    " + line)
            failed += 1
            continue
        finally:
            signal.alarm(0)
        print(f"PASS {name} ({time.monotonic() - start:.2f} s)")
        if verbose:
            for n in helpers.NOTES:
                print("    " + n)
        passed += 1
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
