"""conftest.py - pytest's setup for the CPU tests (pytest python/tests): the package from
this repository's python/, one failure and a stop where libcomet is not built (not one per
test), and each test's notes (helpers.note) printed, so `pytest -rP` shows them.
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers  # noqa: E402 - puts the repository's python/ on sys.path


def pytest_collection_finish(session):
    if not session.items:
        return
    error = helpers.library_error()
    if error is not None:
        pytest.exit(f"FAIL {error}", returncode=1)


@pytest.fixture(autouse=True)
def _print_notes():
    helpers.NOTES.clear()
    yield
    for line in helpers.NOTES:
        print(line)
