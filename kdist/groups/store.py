"""The directory replica groups exchange through: rounds, quorum records, outer states,
heartbeats. Every entry becomes visible whole or not at all.

Layout of ``STORE``::

    manifest.json                 the job's fingerprint, written once by the first group
    live/group-<g>.json           group g's heartbeat: state, pid, host, round, step, time
    rounds/<r>/group-<g>.<a>/     group g's outer gradient for round r, attempt a (orbax,
                                  every process of the group writes its shards)
    rounds/<r>/group-<g>.json     its commit marker: the attempt, fingerprint, step, SHA-256
                                  per file
    rounds/<r>/quorum.json        the groups whose gradients round r averages, written once
    outer/<r:06d>.<a>/            the outer state after round r: weights and outer momentum
    outer/<r>.json                its commit marker (attempt, round, step, members, the
                                  weights' fingerprint, checksums)
    outer/damaged/                outer states found damaged, moved aside (never read)

**Everything is written once.** A gradient or an outer state counts only once its marker
exists; the marker is written after orbax's rename and fsync, and created with ``os.link``
of a fsynced temporary file, which fails if the name exists: the first attempt to commit
an entry wins, and a committed entry is never deleted, rewritten or committed again while
its round is in use. Each attempt writes its own directory (``<a>``, a random id), so a
second attempt — a restarted group publishing a round its killed predecessor had
published, a slow disk finishing an old write — cannot touch what a marker names: a reader
that read a marker reads the values it committed. ``quorum.json`` and ``manifest.json`` are
created the same way: the first proposal wins and every group reads the same one, so all
groups agree on a round's members without talking to each other; a round whose outer state
is already committed keeps that state's members even if its quorum record was lost.

**A full or read-only store** (``ENOSPC``, ``EROFS``, a quota) is waited for: each write
retries with backoff, says ``store full / read-only at PATH, waiting`` once, and gives up
with a :class:`StoreError` after :data:`STORE_WAIT` seconds (nothing committed is lost; a
relaunch resumes from the newest durable outer state).

Why a directory and orbax: every machine of a cluster already mounts the checkpoint storage
(NFS, a bucket through a FUSE mount), orbax writes sharded arrays from several processes
into it, and ``rename``/``link`` are atomic on POSIX file systems and NFS. What it costs
at 100 groups: each round every group writes one copy of the weights (its gradient) and
reads one per member — 100 reads per group per round, ``100 x weights`` read by each
(an all-reduce through storage without a reduction tree); fine for DiLoCo's rounds of
hundreds of steps and small models, the limit for large ones (see benchmarks/README.md).
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from kdist.durable import CHECKSUM, fsync_dir, fsync_tree, probe_writable
from kdist.groups.store_io import (
    StoreError,
    checksums,
    new_attempt,
    orbax_save,
    read_json,
    restore,
    retrying,
    say,
    write_json,
)

HEARTBEAT_EVERY = 1.0  # seconds between heartbeats (a thread; see kdist.groups.sync)
POLL = 0.05  # seconds between looks at the store while waiting
STALE_AFTER = 6.0  # a heartbeat older than this: the group is not running
class Store:
    """One group's view of the shared store (see the module's docstring for the layout).

    Example:
        >>> store = Store("/tmp/kdist-store", group=0)  # doctest: +SKIP
        >>> store.closed_rounds()  # doctest: +SKIP
        []
    """

    def __init__(self, root, group: int, say=say, collective: bool = False):
        self.root = Path(root)
        self.group = group
        self.say = say  # where "store full, waiting" goes (a group: its process 0's output)
        # True when several processes write each orbax save together (a group of several
        # processes): one of them cannot retry a collective save alone, so those are not
        # retried (the markers, written by process 0 alone, still are).
        self.collective = collective

    def _retrying(self, what: str, path, write, wait: float | None = None):
        return retrying(what, path, write, wait, self.say)

    # --- checks and heartbeats ---

    def check_writable(self) -> None:
        """Creates the layout; a store no group can write is an error naming the path."""
        for sub in ("live", "rounds", "outer"):
            try:
                probe_writable(self.root / sub)
            except OSError as e:
                raise StoreError(
                    f"The replica store {self.root / sub} is not writable ({type(e).__name__}: "
                    f"{e.strerror or e}); it is checked before training and before every "
                    f"save. Fix its permissions (e.g. 'chmod u+w {self.root / sub}'), free "
                    f"space, or pass another directory.") from None

    def beat(self, wait: float | None = 0.0, **info) -> None:
        """This group's heartbeat (``state``: starting, training, waiting (a quorum round's
        publish and wait), publishing (an asynchronous round's), exited, dead). A store that
        refuses the write is waited for up to ``wait`` seconds (default none: a heartbeat is
        written again a second later), then a :class:`StoreError`."""
        info = dict(info, time=time.time(), pid=info.get("pid", os.getpid()),
                    host=info.get("host", socket.gethostname()))
        path = self.root / "live" / f"group-{self.group}.json"
        self._retrying(f"group {self.group}'s heartbeat", path,
                       lambda: write_json(path, info), wait)

    def heartbeats(self) -> dict[int, dict]:
        found = {}
        for path in sorted((self.root / "live").glob("group-*.json")):
            try:
                beat = read_json(path)
            except StoreError:
                beat = None  # a damaged heartbeat is no heartbeat: the group is not running
            if beat is not None:
                found[int(path.stem.split("-")[1])] = beat
        return found

    def running(self, now: float | None = None) -> set[int]:
        """Groups that are training now: a fresh heartbeat whose state says so."""
        now = time.time() if now is None else now
        return {g for g, b in self.heartbeats().items()
                if b.get("state") in ("training", "waiting", "publishing")
                and now - b.get("time", 0) < STALE_AFTER}

    def record_join(self, r: int, **info) -> None:
        """Notes that this group (re)joined the job at round ``r`` (``kdist report``)."""
        path = self.root / "joins" / f"group-{self.group}-{time.time_ns()}.json"
        record = dict(info, group=self.group, round=r, time=time.time())
        self._retrying(f"group {self.group}'s join record", path,
                       lambda: write_json(path, record))

    def joins(self) -> list[dict]:
        found = []
        for path in (self.root / "joins").glob("group-*.json"):
            try:
                found.append(read_json(path))
            except StoreError:
                continue  # a damaged join record: the report shows one join fewer
        return sorted((j for j in found if j), key=lambda j: j["time"])

    # --- the job's manifest ---

    def manifest(self, fingerprint: dict) -> tuple[dict, bool]:
        """The job's fingerprint (the first group's, written now if none was), and whether
        this call wrote it."""
        path = self.root / "manifest.json"
        wrote = self._retrying("the job's manifest", path, lambda: write_json(
            path, {"fingerprint": fingerprint, "group": self.group}, exclusive=True))
        return read_json(path), wrote

    # --- rounds ---

    def round_dir(self, r: int) -> Path:
        return self.root / "rounds" / f"{r:06d}"

    def committed(self, r: int, group: int | None = None) -> dict | None:
        """The commit marker of ``group``'s (default: this group's) gradient of round
        ``r``, None if it has none."""
        group = self.group if group is None else group
        return read_json(self.round_dir(r) / f"group-{group}.json")

    def gradient_dir(self, r: int, group: int, meta: dict) -> Path:
        """The directory ``meta`` (a commit marker) names; ``group-<g>`` for markers
        written before attempts had ids."""
        attempt = meta.get("attempt")
        return self.round_dir(r) / (f"group-{group}.{attempt}" if attempt else f"group-{group}")

    def publish(self, r: int, tree: dict, meta: dict, process_index: int = 0,
                attempt: str | None = None) -> dict:
        """Writes this group's outer gradient of round ``r`` as ``attempt`` (every process
        of the group calls this with the same id), then process 0 commits it with its
        marker, unless an earlier attempt of this group committed the round first.
        Returns the marker that stands: this attempt's, or the earlier one (whose values
        every reader uses; this attempt's directory is then deleted, never committed).
        Call :meth:`committed` first to skip the write when the round is already
        committed. Never deletes or rewrites a committed entry."""
        attempt = attempt or new_attempt()
        target = self.round_dir(r) / f"group-{self.group}.{attempt}"
        marker = self.round_dir(r) / f"group-{self.group}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        save = lambda: orbax_save(target, tree, clean=not self.collective)  # noqa: E731
        if self.collective:
            save()
        else:
            self._retrying(f"group {self.group}'s outer gradient of round {r}", target, save)
        if process_index != 0:
            return dict(meta, round=r, group=self.group, attempt=attempt)
        fsync_tree(target)
        meta = dict(meta, round=r, group=self.group, attempt=attempt,
                    checksum_algorithm=CHECKSUM, checksums=checksums(target))
        wrote = self._retrying(f"the commit marker of round {r}", marker,
                               lambda: write_json(marker, meta, exclusive=True))
        if wrote:
            return meta
        # An earlier attempt committed this round first: its entry stands, ours goes.
        shutil.rmtree(target, ignore_errors=True)
        return read_json(marker)

    def published(self, r: int) -> dict[int, dict]:
        """The committed outer gradients of round ``r``: their markers, by group."""
        found = {}
        for path in sorted(self.round_dir(r).glob("group-*.json")):
            meta = read_json(path)
            if meta is not None:
                found[int(path.stem.split("-")[1])] = meta
        return found

    def quorum(self, r: int) -> dict | None:
        return read_json(self.round_dir(r) / "quorum.json")

    def propose(self, r: int, members: list[int], **info) -> dict:
        """Closes round ``r`` with ``members`` unless another group closed it first; the
        record that stands (this one or the earlier one). A round whose outer state is
        already committed was closed before (its record lost): the record written is that
        state's members, not ``members`` — a round's membership is decided once."""
        published = self.published(r)
        committed = self.outer_meta_if_readable(r)
        if committed is not None and committed.get("members") is not None:
            info = dict(info, restored_from=f"outer/{r}.json")
            members = committed["members"]
            attempts = committed.get("attempts") or {}
        else:
            attempts = {str(g): published[g].get("attempt") for g in members if g in published}
        record = dict(info, round=r, members=sorted(members), proposer=self.group,
                      attempts=attempts, time=time.time())
        path = self.round_dir(r) / "quorum.json"
        self._retrying(f"the quorum record of round {r}", path,
                       lambda: write_json(path, record, exclusive=True))
        return self.quorum(r)

    def closed_rounds(self) -> list[int]:
        return sorted(int(p.parent.name) for p in (self.root / "rounds").glob("*/quorum.json"))

    def read(self, r: int, group: int, target: dict, quorum: dict | None = None) -> dict:
        """Group ``group``'s outer gradient of round ``r``, checked against its checksums
        (and against the attempt ``quorum`` names, when it names one), placed as
        ``target``'s ``ShapeDtypeStruct`` leaves say."""
        marker = self.round_dir(r) / f"group-{group}.json"
        meta = read_json(marker)
        if meta is None:
            raise StoreError(f"Round {r}'s quorum lists group {group}, but {marker} is "
                             f"missing: the store was changed by hand.")
        named = ((quorum or {}).get("attempts") or {}).get(str(group))
        if named and meta.get("attempt") != named:
            raise StoreError(f"Round {r}: its quorum record closed it with attempt {named} of "
                             f"group {group}'s outer gradient, but {marker} commits attempt "
                             f"{meta.get('attempt')}: the round was published twice.")
        source = self.gradient_dir(r, group, meta)
        _verify(source, meta, f"group {group}'s outer gradient of round {r}")
        return restore(source, target)

    # --- outer states ---

    def outer_rounds(self) -> list[int]:
        """Rounds whose outer state has a commit marker, oldest first (see
        :meth:`durable_outer` for the newest that is also intact)."""
        return sorted(int(p.stem) for p in (self.root / "outer").glob("*.json")
                      if p.stem.isdigit())

    def outer_dir(self, r: int, meta: dict | None = None) -> Path:
        """The directory of round ``r``'s outer state that its marker names."""
        meta = self.outer_meta(r) if meta is None else meta
        name = (meta or {}).get("directory") or f"{r:06d}"
        return self.root / "outer" / name

    def save_outer(self, r: int, tree: dict, meta: dict, process_index: int = 0,
                   attempt: str | None = None) -> dict:
        """Writes the outer state after round ``r`` as ``attempt`` (every process of the
        group calls this with the same id); process 0 makes it durable, then commits it —
        unless it is committed already, which stands. Returns the marker that stands."""
        attempt = attempt or new_attempt()
        marker = self.root / "outer" / f"{r}.json"
        standing = self.outer_meta_if_readable(r)
        if standing is not None:  # committed before (a restarted committer): kept as is
            return standing
        target = self.root / "outer" / f"{r:06d}.{attempt}"
        save = lambda: orbax_save(target, tree, clean=not self.collective)  # noqa: E731
        if self.collective:
            save()
        else:
            self._retrying(f"the outer state of round {r}", target, save)
        if process_index != 0:
            return dict(meta, round=r, attempt=attempt)
        fsync_tree(target)
        meta = dict(meta, round=r, attempt=attempt, directory=target.name,
                    checksum_algorithm=CHECKSUM, checksums=checksums(target))
        if self._retrying(f"the commit marker of round {r}'s outer state", marker,
                          lambda: write_json(marker, meta, exclusive=True)):
            return meta
        shutil.rmtree(target, ignore_errors=True)  # another attempt committed it first
        return read_json(marker)

    def outer_meta(self, r: int) -> dict | None:
        return read_json(self.root / "outer" / f"{r}.json")

    def outer_meta_if_readable(self, r: int) -> dict | None:
        try:
            return self.outer_meta(r)
        except StoreError:
            return None  # a damaged marker counts as none here (recovery names it)

    def verify_outer(self, r: int) -> None:
        """Checks round ``r``'s outer state against the checksums of its marker; a
        :class:`StoreError` naming the damaged file if it is not intact."""
        meta = self.outer_meta(r)
        _verify(self.outer_dir(r, meta), meta, f"the outer state of round {r}")

    def load_outer(self, r: int, target: dict, verify: bool = True) -> dict:
        meta = self.outer_meta(r)
        if verify:
            _verify(self.outer_dir(r, meta), meta, f"the outer state of round {r}")
        return restore(self.outer_dir(r, meta), target)

    def set_aside_outer(self, r: int) -> Path:
        """Moves round ``r``'s damaged outer state (its marker first: it stops counting at
        once) into ``outer/damaged/``, where nothing reads it; returns where it went."""
        aside = self.root / "outer" / "damaged"
        aside.mkdir(parents=True, exist_ok=True)
        stamp = time.time_ns()
        marker = self.root / "outer" / f"{r}.json"
        try:
            directory = self.outer_dir(r)
        except StoreError:
            directory = None  # the marker itself is damaged: every directory of round r
        if marker.exists():
            os.replace(marker, aside / f"{r}.json.{stamp}")
        for path in ([directory] if directory else
                     list((self.root / "outer").glob(f"{r:06d}*"))):
            if path.exists():
                os.replace(path, aside / f"{path.name}.{stamp}")
        fsync_dir(self.root / "outer")
        return aside

    def durable_outer(self) -> int | None:
        """The newest round whose outer state is committed and intact (its marker reads, its
        files match their checksums); None if there is none. What a relaunch resumes from."""
        for r in reversed(self.outer_rounds()):
            try:
                self.verify_outer(r)
            except StoreError:
                continue
            return r
        return None

    def forget_before(self, r: int) -> None:
        """Deletes the gradients and outer states of rounds older than ``r`` (never the newest
        committed outer state before it: a joining group starts from one). The quorum
        records stay: they are the job's history of who took part (a few bytes each)."""
        kept = [k for k in self.outer_rounds() if k < r]
        keep_outer = kept[-1] if kept else None
        for k in kept[:-1]:
            (self.root / "outer" / f"{k}.json").unlink(missing_ok=True)
            for path in (self.root / "outer").glob(f"{k:06d}*"):
                shutil.rmtree(path, ignore_errors=True)
        floor = r if keep_outer is None else min(r, keep_outer + 1)
        for path in (self.root / "rounds").glob("*"):  # the gradients; quorum records stay
            if path.name.isdigit() and int(path.name) < floor:
                for entry in path.glob("group-*"):
                    if entry.is_dir():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)


def _verify(root: Path, meta: dict | None, what: str) -> None:
    if meta is None:
        raise StoreError(f"{what} has no commit marker in {root.parent}.")
    found = checksums(root)
    bad = sorted(k for k, v in meta.get("checksums", {}).items() if found.get(k) != v)
    if bad:
        raise StoreError(f"{what} in {root} is damaged: {', '.join(bad[:3])} "
                         f"{'differ' if len(bad) > 1 else 'differs'} from the checksum "
                         f"recorded when it was committed.")


def describe(root) -> dict[str, Any]:
    """What the store holds, for ``kdist report``: closed rounds (their quorum records), the
    newest intact outer state, each group's last heartbeat, every join, the manifest."""
    store = Store(root, group=-1)
    rounds = {}
    for r in store.closed_rounds():
        try:
            rounds[r] = store.quorum(r)
        except StoreError:
            continue  # a damaged record: the report shows the rounds it can read
    return {"rounds": {r: q for r, q in rounds.items() if q},
            "outer": store.durable_outer(), "heartbeats": store.heartbeats(),
            "joins": store.joins(), "manifest": read_json(store.root / "manifest.json")}
