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

import errno
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from kdist.durable import CHECKSUM, file_checksum, fsync_dir, fsync_tree, probe_writable

HEARTBEAT_EVERY = 1.0  # seconds between heartbeats (a thread; see kdist.groups.sync)
STALE_AFTER = 6.0  # a heartbeat older than this: the group is not running
STORE_WAIT = 300.0  # seconds a write waits for a full or read-only store before giving up
# Errors that mean "the store cannot take this write now", not "the write is wrong": a full
# disk or quota, a file system remounted read-only, permissions taken away, an I/O error of
# a network mount. Worth waiting for; anything else is raised at once.
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                  errno.EIO}


class StoreError(RuntimeError):
    """The store is unusable, damaged, or a round cannot close."""


def storage_unavailable(error: BaseException) -> bool:
    """Whether ``error`` is the store refusing writes (full, read-only), which may pass.
    orbax reports a full disk as ``ValueError("RESOURCE_EXHAUSTED...")``, not an OSError."""
    if isinstance(error, OSError) and error.errno in STORAGE_ERRNOS:
        return True
    text = str(error)
    return any(k in text for k in ("RESOURCE_EXHAUSTED", "No space left", "Read-only file"))


def _print(text: str) -> None:
    """``[groups] text`` on stdout; output that cannot be written (a closed pipe: the
    supervisor died) is dropped, never raised — it must not stop a save."""
    try:
        print(f"[groups] {text}", flush=True)
    except (OSError, ValueError):
        pass


def retrying(what: str, path, write, wait: float | None = None, say=_print):
    """Runs ``write()``; while the store refuses writes (:func:`storage_unavailable`),
    retries with backoff (0.1 s doubling to 5 s), saying once ``store full / read-only at
    PATH, waiting`` and once that it went on. After ``wait`` seconds (default
    :data:`STORE_WAIT`; 0: no retry) a :class:`StoreError` naming ``what`` and ``path``."""
    limit = STORE_WAIT if wait is None else wait
    began, delay, said = time.monotonic(), 0.1, False
    while True:
        try:
            result = write()
        except Exception as e:  # noqa: BLE001 (filtered just below)
            if not storage_unavailable(e):
                raise
            waited = time.monotonic() - began
            if waited >= limit:
                raise StoreError(
                    f"The replica store at {path} stayed full or read-only for {waited:.0f} s "
                    f"({e}): {what} was not written. Free space (or make it writable) and "
                    f"relaunch: the job resumes from its newest durable outer state.") from e
            if not said:
                said = True
                say(f"store full / read-only at {path} ({e}), waiting up to {limit:.0f} s "
                    f"to write {what}")
            time.sleep(min(delay, max(limit - waited, 0.0)))
            delay = min(2 * delay, 5.0)
            continue
        if said:
            say(f"store at {path} writable again after {time.monotonic() - began:.1f} s: "
                f"{what} written")
        return result


def _write_json(path: Path, value: dict, exclusive: bool = False) -> bool:
    """Writes ``value`` to ``path`` atomically (a temporary file, fsynced, renamed; with
    ``exclusive`` linked, so an existing ``path`` is kept). Returns False only when
    ``exclusive`` and ``path`` already existed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    try:
        if exclusive:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
        else:
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True


def _read_json(path: Path) -> dict | None:
    """The JSON object in ``path``, None if there is no such file; a file that is not one
    (emptied, truncated, overwritten by hand) is a :class:`StoreError` naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as e:
        raise StoreError(f"{path} is damaged: not UTF-8 text ({e}).") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise StoreError(f"{path} is damaged: {len(text.encode())} bytes that are not a JSON "
                         f"record ({e}).") from None
    if not isinstance(value, dict):
        raise StoreError(f"{path} is damaged: a JSON {type(value).__name__}, not a record.")
    return value


def new_attempt() -> str:
    """A random id naming one attempt's directory (every process of a group must use the
    same one: :func:`kdist.groups.sync.agree` it)."""
    return os.urandom(6).hex()


def _orbax_save(target: Path, tree: dict, clean: bool) -> None:
    """Saves ``tree`` to ``target`` with orbax; with ``clean`` (one process writes it all)
    first removing what a failed try of this same attempt left (a full disk interrupts a
    save half-way). Never with several processes: another one may be writing there now."""
    import orbax.checkpoint as ocp

    for leftover in target.parent.glob(f"{target.name}*") if clean else ():
        shutil.rmtree(leftover, ignore_errors=True)
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(target, args=ocp.args.PyTreeSave(tree))


def _checksums(root: Path) -> dict[str, str]:
    return {str(f.relative_to(root)): file_checksum(f)
            for f in sorted(root.rglob("*")) if f.is_file() and f.name != "_CHECKPOINT_METADATA"}


class Store:
    """One group's view of the shared store (see the module's docstring for the layout).

    Example:
        >>> store = Store("/tmp/kdist-store", group=0)  # doctest: +SKIP
        >>> store.closed_rounds()  # doctest: +SKIP
        []
    """

    def __init__(self, root, group: int, say=_print, collective: bool = False):
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
                       lambda: _write_json(path, info), wait)

    def heartbeats(self) -> dict[int, dict]:
        found = {}
        for path in sorted((self.root / "live").glob("group-*.json")):
            try:
                beat = _read_json(path)
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
                       lambda: _write_json(path, record))

    def joins(self) -> list[dict]:
        found = []
        for path in (self.root / "joins").glob("group-*.json"):
            try:
                found.append(_read_json(path))
            except StoreError:
                continue  # a damaged join record: the report shows one join fewer
        return sorted((j for j in found if j), key=lambda j: j["time"])

    # --- the job's manifest ---

    def manifest(self, fingerprint: dict) -> tuple[dict, bool]:
        """The job's fingerprint (the first group's, written now if none was), and whether
        this call wrote it."""
        path = self.root / "manifest.json"
        wrote = self._retrying("the job's manifest", path, lambda: _write_json(
            path, {"fingerprint": fingerprint, "group": self.group}, exclusive=True))
        return _read_json(path), wrote

    # --- rounds ---

    def round_dir(self, r: int) -> Path:
        return self.root / "rounds" / f"{r:06d}"

    def committed(self, r: int, group: int | None = None) -> dict | None:
        """The commit marker of ``group``'s (default: this group's) gradient of round
        ``r``, None if it has none."""
        group = self.group if group is None else group
        return _read_json(self.round_dir(r) / f"group-{group}.json")

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
        save = lambda: _orbax_save(target, tree, clean=not self.collective)  # noqa: E731
        if self.collective:
            save()
        else:
            self._retrying(f"group {self.group}'s outer gradient of round {r}", target, save)
        if process_index != 0:
            return dict(meta, round=r, group=self.group, attempt=attempt)
        fsync_tree(target)
        meta = dict(meta, round=r, group=self.group, attempt=attempt,
                    checksum_algorithm=CHECKSUM, checksums=_checksums(target))
        wrote = self._retrying(f"the commit marker of round {r}", marker,
                               lambda: _write_json(marker, meta, exclusive=True))
        if wrote:
            return meta
        # An earlier attempt committed this round first: its entry stands, ours goes.
        shutil.rmtree(target, ignore_errors=True)
        return _read_json(marker)

    def published(self, r: int) -> dict[int, dict]:
        """The committed outer gradients of round ``r``: their markers, by group."""
        found = {}
        for path in sorted(self.round_dir(r).glob("group-*.json")):
            meta = _read_json(path)
            if meta is not None:
                found[int(path.stem.split("-")[1])] = meta
        return found

    def quorum(self, r: int) -> dict | None:
        return _read_json(self.round_dir(r) / "quorum.json")

    def propose(self, r: int, members: list[int], **info) -> dict:
        """Closes round ``r`` with ``members`` unless another group closed it first; the
        record that stands (this one or the earlier one). A round whose outer state is
        already committed was closed before (its record lost): the record written is that
        state's members, not ``members`` — a round's membership is decided once."""
        published = self.published(r)
        committed = self._outer_meta_or_none(r)
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
                       lambda: _write_json(path, record, exclusive=True))
        return self.quorum(r)

    def closed_rounds(self) -> list[int]:
        return sorted(int(p.parent.name) for p in (self.root / "rounds").glob("*/quorum.json"))

    def read(self, r: int, group: int, target: dict, quorum: dict | None = None) -> dict:
        """Group ``group``'s outer gradient of round ``r``, checked against its checksums
        (and against the attempt ``quorum`` names, when it names one), placed as
        ``target``'s ``ShapeDtypeStruct`` leaves say."""
        marker = self.round_dir(r) / f"group-{group}.json"
        meta = _read_json(marker)
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
        return _restore(source, target)

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
        standing = self._outer_meta_or_none(r)
        if standing is not None:  # committed before (a restarted committer): kept as is
            return standing
        target = self.root / "outer" / f"{r:06d}.{attempt}"
        save = lambda: _orbax_save(target, tree, clean=not self.collective)  # noqa: E731
        if self.collective:
            save()
        else:
            self._retrying(f"the outer state of round {r}", target, save)
        if process_index != 0:
            return dict(meta, round=r, attempt=attempt)
        fsync_tree(target)
        meta = dict(meta, round=r, attempt=attempt, directory=target.name,
                    checksum_algorithm=CHECKSUM, checksums=_checksums(target))
        if self._retrying(f"the commit marker of round {r}'s outer state", marker,
                          lambda: _write_json(marker, meta, exclusive=True)):
            return meta
        shutil.rmtree(target, ignore_errors=True)  # another attempt committed it first
        return _read_json(marker)

    def outer_meta(self, r: int) -> dict | None:
        return _read_json(self.root / "outer" / f"{r}.json")

    def _outer_meta_or_none(self, r: int) -> dict | None:
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
        return _restore(self.outer_dir(r, meta), target)

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
    found = _checksums(root)
    bad = sorted(k for k, v in meta.get("checksums", {}).items() if found.get(k) != v)
    if bad:
        raise StoreError(f"{what} in {root} is damaged: {', '.join(bad[:3])} "
                         f"{'differ' if len(bad) > 1 else 'differs'} from the checksum "
                         f"recorded when it was committed.")


def _restore(source: Path, target: dict) -> dict:
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as checkpointer:
        return checkpointer.restore(source, args=ocp.args.PyTreeRestore(
            target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))


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
            "joins": store.joins(), "manifest": _read_json(store.root / "manifest.json")}
