#!/usr/bin/env python3
"""run_cpu.py - the tests of the comet_moe package that need no GPU: the library loads
and is found (or the error says how to get it), the ctypes mirror of comet.h (struct
field order, sizes, offsets, the *_INIT initializers, enum values and every bound
function's signature, all read from the header itself, no C compiler), comet's statuses
as exceptions through real C calls that fail on a CPU, presets, and the forward call's
argument checks on small stand-in tensors. Tests that need torch run when it is
installed (on the CPU, against a stand-in for the comet layer) and print SKIP otherwise.

The tests live beside this file, run in this order: cpu_capi.py (the library, the mirror
of comet.h, statuses, presets), cpu_args.py (the forward call's checks on stand-in
tensors), cpu_torch.py (with torch); this file holds their shared helpers and the runner.

Prints PASS/FAIL/SKIP per test, as tests/runner.c does, and ends with
"N passed, N failed, N skipped"; exit status 1 when anything failed. No install needed:
python/ goes on sys.path.

    python3 python/tests/run_cpu.py [-v] [SUBSTRING...]   (-v: print passing tests' notes)
"""
from __future__ import annotations

import signal
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))
TESTS = []
NOTES = []


class Skip(Exception):
    pass


def test(fn):
    TESTS.append(fn)
    return fn


def note(msg):
    NOTES.append(msg)


def check(cond, msg="check failed"):
    if not cond:
        raise AssertionError(msg)


def check_eq(got, want, what=""):
    if got != want:
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")


def raises(exc_type, fn, *contains):
    """fn() must raise exc_type whose message contains every string of `contains`."""
    try:
        fn()
    except exc_type as e:
        for s in contains:
            if s not in str(e):
                raise AssertionError(f"{type(e).__name__} message {str(e)!r} lacks {s!r}") from None
        return e
    except Exception as e:
        raise AssertionError(f"expected {exc_type.__name__}, got {type(e).__name__}: {e}") from None
    raise AssertionError(f"expected {exc_type.__name__}, nothing was raised")


def need_torch():
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError:
        raise Skip("torch is not installed (pip install torch to run it)") from None
    except ImportError as e:  # installed, but it does not load (say, another libnccl loaded first)
        raise Skip(f"torch does not import: {e}") from None
    return torch


# ---- the tests, in the order they run: each module registers its own with @test ----

# The modules import the helpers above from "run_cpu": run as a script this file is
# __main__, so it is named run_cpu too (one TESTS list, not a second copy of the module).
sys.modules.setdefault("run_cpu", sys.modules[__name__])
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_capi  # noqa: E402,F401 - the library, the mirror of comet.h, statuses, presets
import cpu_args  # noqa: E402,F401 - the forward call's checks on stand-in tensors
import cpu_torch  # noqa: E402,F401 - with torch, on the CPU
import cpu_megatron  # noqa: E402,F401 - the Megatron-Core adapter (its glue with megatron-core)


# ---- the runner ----

def main(argv):
    verbose = "-v" in argv
    filters = [a for a in argv if a != "-v"]
    passed = failed = skipped = 0

    def on_alarm(signum, frame):
        raise TimeoutError("timed out after 120 s")

    signal.signal(signal.SIGALRM, on_alarm)
    for fn in TESTS:
        name = fn.__name__
        if filters and not any(f in name for f in filters):
            continue
        NOTES.clear()
        start = time.monotonic()
        signal.alarm(120)
        try:
            fn()
        except Skip as e:
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
            for n in NOTES:
                print("    " + n)
        passed += 1
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
