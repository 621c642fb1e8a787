"""Reference runs shared by the test session's processes (pytest-xdist's workers).

The parity harness trains each 1-device reference once per process and memoises it
(tests/parallel/harness.py: ``reference_run``). Under ``make test`` the rows that compare
with one reference are spread over both workers, so each trained it: 49 references for 138
rows, most of them twice. Here the first process to need a reference trains it and leaves
its numbers (losses, weights, optimizer slots: the :class:`Run` without its model) in a
folder of this session's; another process that needs it waits for that one (a lock per
reference) and reads them, bit for bit what it would have computed: the same program on the
same devices with the same seed.

The folder is ``$KDIST_TEST_SHARED_RUNS`` (tests/conftest.py sets it to one under the
session's pytest temporary folder, shared by its workers); unset, nothing is shared.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable
from pathlib import Path

from kdist.data.token_store import exclusive

VARIABLE = "KDIST_TEST_SHARED_RUNS"


def shared(key: str, compute: Callable[[], object]):
    """``compute()``'s result for ``key``: computed by the first process of the session that
    asks, read from its file by the others."""
    folder = os.environ.get(VARIABLE)
    if not folder:
        return compute()
    folder = Path(folder)
    name = hashlib.sha256(key.encode()).hexdigest()[:32]
    stored = folder / f"{name}.pickle"
    with exclusive(folder / f"{name}.lock"):
        if stored.is_file():
            with open(stored, "rb") as f:
                found_key, value = pickle.load(f)
            assert found_key == key, (found_key, key)  # a hash collision would show here
            return value
        value = compute()
        partial = stored.with_suffix(f".{os.getpid()}.tmp")
        with open(partial, "wb") as f:
            pickle.dump((key, value), f)
        os.replace(partial, stored)  # whole or absent, for a reader after a crash
        return value
