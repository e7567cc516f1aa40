"""helpers.py - what the CPU test modules (test_*.py beside this file) share: checks that
print both sides, a skip that is pytest's where pytest is installed and run_cpu.py's
otherwise, notes a test leaves for -v, and where the repository is.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))

try:
    import pytest
except ImportError:  # run_cpu.py runs the tests without pytest
    pytest = None

NOTES = []


if pytest is not None:
    Skip = pytest.skip.Exception
else:
    class Skip(Exception):
        """A test that cannot run here, with the reason (run_cpu.py prints SKIP and it)."""


def skip(reason: str):
    """End the test as skipped, saying why."""
    if pytest is not None:
        pytest.skip(reason)
    raise Skip(reason)


def note(msg):
    """A line the test leaves for the reader: run_cpu.py -v prints it, pytest shows it with -rP."""
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
    """torch, or a skip saying why it cannot be had."""
    try:
        import torch
    except ModuleNotFoundError:
        skip("torch is not installed (pip install torch to run it)")
    except ImportError as e:  # installed, but it does not load (say, another libnccl loaded first)
        skip(f"torch does not import: {e}")
    return torch


def library_error():
    """None when libcomet loads, else what to say: the one failure the CPU tests report
    on a tree that was not built (every other test would fail the same way)."""
    import comet_moe
    try:
        comet_moe.version()
    except comet_moe.LibraryNotFoundError as e:
        return f"libcomet cannot be loaded; build first (make): {e}"
    return None
