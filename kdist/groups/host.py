"""A group job's host-side plumbing: output that never raises (its stdout is a pipe to a
supervisor that may die), ``[groups]`` lines, the heartbeat thread, and values agreed by
the processes of one group.

Example:
    >>> agree(3)  # one process: its own value
    3
"""

from __future__ import annotations

import os
import sys
import threading

import jax
import numpy as np

from kdist.groups.store import HEARTBEAT_EVERY, Store, StoreError


class _Output:
    """A group's stdout or stderr that never raises: both are a pipe to the supervisor,
    and a supervisor that died closes it. A write that fails (``BrokenPipeError``) points
    the file descriptor at ``/dev/null`` and drops the text, so a ``print`` in a round, a
    callback or the SIGTERM save's own messages cannot stop the save the SIGTERM asked for
    (nor the interpreter's last flush turn a clean exit into status 120)."""

    def __init__(self, stream):
        self._stream, self._broken = stream, False

    def _break(self):
        self._broken = True
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        except (OSError, ValueError, AttributeError):
            pass

    def write(self, text):
        if not self._broken:
            try:
                return self._stream.write(text)
            except (OSError, ValueError):
                self._break()
        return len(text)

    def flush(self):
        if not self._broken:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self._break()

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the stream's own
        return getattr(self._stream, name)


def guard_output() -> None:
    """Makes this process's stdout and stderr :class:`_Output` (once)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Output):
            setattr(sys, name, _Output(stream))


def say(text: str) -> None:
    """``[groups] text`` from process 0; never raises for output that cannot be written."""
    if jax.process_index() == 0:
        try:
            print(f"[groups] {text}", flush=True)
        except (OSError, ValueError):
            pass


class Heartbeat:
    """Writes this group's heartbeat every second from a thread (process 0 only): a
    stalled or stopped process goes stale, a busy one (compiling, validating) does not."""

    def __init__(self, store: Store):
        self.store, self.info = store, {"state": "starting", "round": None, "step": None}
        self.token = os.urandom(8).hex()
        self.failed = False  # the last write failed (said once until one succeeds)
        self._lock = threading.Lock()  # one writer at a time: a beat never undoes a newer one
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kdist-heartbeat")

    def start(self):
        self.beat()
        self._thread.start()
        import atexit

        atexit.register(self.stop)

    def beat(self, **info):
        """Writes the heartbeat now. Best effort: a store that refuses the write (full,
        read-only) costs this beat only — the group goes stale for the others (no round
        waits for it) but keeps training; the round's own writes wait for the store."""
        with self._lock:
            self.info.update(info)
            try:
                self.store.beat(token=self.token, **self.info)
            except (OSError, StoreError) as e:
                if not self.failed:
                    say(f"heartbeat not written ({e}); trying again every second")
                self.failed = True
            else:
                self.failed = False

    def _run(self):
        while not self._stop.wait(HEARTBEAT_EVERY):
            self.beat()

    def stop(self):
        if not self._stop.is_set():
            self._stop.set()
            self.beat(state="exited")


def agree(value: int) -> int:
    """Process 0's ``value`` in every process of this group."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int64(value)))


def alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:
        return True
    return True
