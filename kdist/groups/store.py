"""The directory replica groups exchange through: rounds, quorum records, outer states,
heartbeats. Every entry becomes visible whole or not at all.

Layout of ``STORE``::

    manifest.json                 the job's fingerprint, written once by the first group
    live/group-<g>.json           group g's heartbeat: state, pid, host, round, step, time
    rounds/<r>/group-<g>/         group g's outer gradient for round r (orbax, every process
                                  of the group writes its shards; renamed into place)
    rounds/<r>/group-<g>.json     its commit marker: fingerprint, step, SHA-256 per file
    rounds/<r>/quorum.json        the groups whose gradients round r averages, written once
    outer/<r>/                    the outer state after round r: weights and outer momentum
    outer/<r>.json                its commit marker (round, step, members, checksums)

A gradient or an outer state counts only once its marker exists; the marker is written
after orbax's rename and fsync, through a temporary file renamed into place, so a reader
never sees a torn entry. ``quorum.json`` and ``manifest.json`` are created with
``os.link`` (fails if the name exists): the first proposal wins and every group reads the
same one, so all groups agree on a round's members without talking to each other.

Why a directory and orbax: every machine of a cluster already mounts the checkpoint storage
(NFS, a bucket through a FUSE mount), orbax writes sharded arrays from several processes
into it, and ``rename``/``link`` are atomic on POSIX file systems and NFS. What it costs
at 100 groups: each round every group writes one copy of the weights (its gradient) and
reads one per member — 100 reads per group per round, ``100 x weights`` read by each
(an all-reduce through storage without a reduction tree); fine for DiLoCo's rounds of
hundreds of steps and small models, the limit for large ones (see benchmarks/README.md).
"""

from __future__ import annotations

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


class StoreError(RuntimeError):
    """The store is unusable, damaged, or a round cannot close."""


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
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


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

    def __init__(self, root, group: int):
        self.root = Path(root)
        self.group = group

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

    def beat(self, **info) -> None:
        """This group's heartbeat (``state``: starting, training, waiting (a quorum round's
        publish and wait), publishing (an asynchronous round's), exited, dead)."""
        info = dict(info, time=time.time(), pid=info.get("pid", os.getpid()),
                    host=info.get("host", socket.gethostname()))
        _write_json(self.root / "live" / f"group-{self.group}.json", info)

    def heartbeats(self) -> dict[int, dict]:
        found = {}
        for path in sorted((self.root / "live").glob("group-*.json")):
            beat = _read_json(path)
            if beat is not None:
                found[int(path.stem.split("-")[1])] = beat
        return found

    def running(self, now: float | None = None) -> set[int]:
        """Groups that are training now: a fresh heartbeat whose state says so."""
        now = time.time() if now is None else now
        return {g for g, b in self.heartbeats().items()
                if b.get("state") in ("training", "waiting", "publishing")
                and now - b.get("time", 0) < STALE_AFTER}

    def record_join(self, r: int) -> None:
        """Notes that this group (re)joined the job at round ``r`` (``kdist report``)."""
        _write_json(self.root / "joins" / f"group-{self.group}-{time.time_ns()}.json",
                    {"group": self.group, "round": r, "time": time.time()})

    def joins(self) -> list[dict]:
        found = [_read_json(p) for p in (self.root / "joins").glob("group-*.json")]
        return sorted((j for j in found if j), key=lambda j: j["time"])

    # --- the job's manifest ---

    def manifest(self, fingerprint: dict) -> tuple[dict, bool]:
        """The job's fingerprint (the first group's, written now if none was), and whether
        this call wrote it."""
        path = self.root / "manifest.json"
        wrote = _write_json(path, {"fingerprint": fingerprint, "group": self.group},
                            exclusive=True)
        return _read_json(path), wrote

    # --- rounds ---

    def round_dir(self, r: int) -> Path:
        return self.root / "rounds" / f"{r:06d}"

    def publish(self, r: int, tree: dict, meta: dict, process_index: int = 0) -> None:
        """Writes this group's outer gradient of round ``r`` (every process of the group
        calls this), then process 0 commits it with its marker."""
        import orbax.checkpoint as ocp

        target = self.round_dir(r) / f"group-{self.group}"
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():  # left by a killed attempt of this group: never committed
            if process_index == 0:
                shutil.rmtree(target, ignore_errors=True)
        with ocp.PyTreeCheckpointer() as checkpointer:
            checkpointer.save(target, args=ocp.args.PyTreeSave(tree))
        if process_index == 0:
            fsync_tree(target)
            meta = dict(meta, round=r, group=self.group, checksum_algorithm=CHECKSUM,
                        checksums=_checksums(target))
            _write_json(target.with_suffix(".json"), meta)

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
        record that stands (this one or the earlier one)."""
        record = dict(info, round=r, members=sorted(members), proposer=self.group,
                      time=time.time())
        _write_json(self.round_dir(r) / "quorum.json", record, exclusive=True)
        return self.quorum(r)

    def closed_rounds(self) -> list[int]:
        return sorted(int(p.parent.name) for p in (self.root / "rounds").glob("*/quorum.json"))

    def read(self, r: int, group: int, target: dict) -> dict:
        """Group ``group``'s outer gradient of round ``r``, checked against its checksums,
        placed as ``target``'s ``ShapeDtypeStruct`` leaves say."""
        source = self.round_dir(r) / f"group-{group}"
        meta = _read_json(source.with_suffix(".json"))
        if meta is None:
            raise StoreError(f"Round {r}'s quorum lists group {group}, but {source} has no "
                             f"commit marker: the store was changed by hand.")
        _verify(source, meta, f"group {group}'s outer gradient of round {r}")
        return _restore(source, target)

    # --- outer states ---

    def outer_rounds(self) -> list[int]:
        """Rounds whose outer state is committed, oldest first."""
        return sorted(int(p.stem) for p in (self.root / "outer").glob("*.json")
                      if p.stem.isdigit())

    def save_outer(self, r: int, tree: dict, meta: dict, process_index: int = 0) -> Path:
        """Writes the outer state after round ``r`` (every process of the group calls this);
        process 0 makes it durable, then commits it. Returns its directory."""
        import orbax.checkpoint as ocp

        target = self.root / "outer" / f"{r:06d}"
        if target.exists() and process_index == 0:  # an attempt that never committed
            shutil.rmtree(target, ignore_errors=True)
        with ocp.PyTreeCheckpointer() as checkpointer:
            checkpointer.save(target, args=ocp.args.PyTreeSave(tree))
        if process_index == 0:
            fsync_tree(target)
            meta = dict(meta, round=r, checksum_algorithm=CHECKSUM,
                        checksums=_checksums(target))
            _write_json(self.root / "outer" / f"{r}.json", meta)
        return target

    def outer_meta(self, r: int) -> dict | None:
        return _read_json(self.root / "outer" / f"{r}.json")

    def load_outer(self, r: int, target: dict) -> dict:
        source = self.root / "outer" / f"{r:06d}"
        _verify(source, self.outer_meta(r), f"the outer state of round {r}")
        return _restore(source, target)

    def forget_before(self, r: int) -> None:
        """Deletes the gradients and outer states of rounds older than ``r`` (never the newest
        committed outer state before it: a joining group starts from one). The quorum
        records stay: they are the job's history of who took part (a few bytes each)."""
        kept = [k for k in self.outer_rounds() if k < r]
        keep_outer = kept[-1] if kept else None
        for k in kept[:-1]:
            (self.root / "outer" / f"{k}.json").unlink(missing_ok=True)
            shutil.rmtree(self.root / "outer" / f"{k:06d}", ignore_errors=True)
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
    newest outer state, each group's last heartbeat, every join, the manifest."""
    store = Store(root, group=-1)
    rounds = {r: store.quorum(r) for r in store.closed_rounds()}
    outer = store.outer_rounds()
    return {"rounds": {r: q for r, q in rounds.items() if q},
            "outer": outer[-1] if outer else None, "heartbeats": store.heartbeats(),
            "joins": store.joins(), "manifest": _read_json(store.root / "manifest.json")}
