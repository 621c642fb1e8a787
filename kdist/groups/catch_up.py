"""How a group job reaches a closed round (:class:`kdist.groups.sync.OuterSync`'s part
that joins and catches up): the newest intact committed outer state at or before it, then
the rounds closed after that replayed from their committed gradients; a damaged outer
state named, moved aside and rebuilt.

Example:
    >>> from kdist.groups import catch_up, sync
    >>> issubclass(sync.OuterSync, catch_up.CatchUp)
    True
"""

from __future__ import annotations

import time

from kdist.groups import outer_arrays as arrays
from kdist.groups.host import agree, say
from kdist.groups.store import POLL, StoreError


class CatchUp:
    """Methods of :class:`kdist.groups.sync.OuterSync` (its ``store``, ``job``, ``model``,
    ``process``, ``applied`` round and ``damaged`` states) that bring it to a round."""


    def _catch_up(self, state, latest: int):
        """Brings this group to round ``latest``: the newest committed outer state at or
        before it, then the closed rounds after that replayed from their gradients."""
        theta, momenta, _ = self._parts(state)
        target = arrays.targets(theta)
        base = self._intact_base(latest)
        if base is None or (self.applied is not None and self.applied > base):
            if self.applied is None:  # no outer state to start from: wait for the first
                base = self._wait_for_outer(latest)
            else:
                base = self.applied  # replay on what this group already holds
        if base != self.applied:
            loaded = self.store.load_outer(base, {"theta": arrays.tree(target),
                                                  "momenta": arrays.tree(target)}, verify=False)
            theta, momenta = arrays.leaves(loaded["theta"]), arrays.leaves(loaded["momenta"])
        for r in range(base + 1, latest + 1):
            record = self.store.quorum(r)
            if record is None:
                raise StoreError(f"Round {r} has no quorum record in {self.store.root}, but "
                                 f"round {latest} closed: the store was changed by hand.")
            published = self.store.published(r)
            try:
                deltas = [arrays.leaves(self.store.read(r, g, arrays.tree(target), record))
                          for g in record["members"]]
            except StoreError as e:
                if r not in self.damaged:
                    raise
                raise StoreError(f"The outer state of round {r} was damaged (moved aside to "
                                 f"{self.store.root / 'outer' / 'damaged'}) and cannot be "
                                 f"rebuilt from round {r}'s gradients: {e} Start the job "
                                 f"again with a new store, or from a checkpoint.") from None
            theta, momenta = arrays.outer_step(self.model.optimizer, self.job, theta, momenta,
                                               deltas, published, record["members"], r)
            digest = self._applied(r, theta, momenta, record["members"])
            if r in self.damaged:  # rebuilt: commit it again, so the store is whole
                old = self.damaged.pop(r) or {}  # process 0's reading of the old marker
                if agree(int(old.get("digest") not in (None, digest))):
                    raise StoreError(f"Round {r}'s outer state rebuilt from its gradients "
                                     f"(fingerprint {digest}) differs from the damaged one's "
                                     f"marker (fingerprint {old.get('digest')}).")
                self._commit(r, theta, momenta, record["members"], published, digest)
                say(f"the outer state of round {r} rebuilt from round {r - 1}'s and round "
                    f"{r}'s committed gradients and committed again")
        self.applied = latest
        self._verify_pending()
        return self._with(state, theta, momenta)

    def _intact_base(self, latest: int) -> int | None:
        """The newest committed outer state at or before round ``latest`` that is intact.
        A damaged one (a data file that differs from its checksum, an emptied or truncated
        marker) is named, moved aside (``outer/damaged/``) and remembered in
        :attr:`damaged`, to be rebuilt from the previous state and the round's committed
        gradients (:meth:`_catch_up`); the search goes on with the one before it."""
        while True:
            outer = [k for k in self.store.outer_rounds() if k <= latest]
            base = agree(outer[-1] if outer else -1)
            if base < 0:
                return None
            problem = None
            if self.process == 0:
                try:
                    self.store.verify_outer(base)
                except StoreError as e:
                    problem = e
            if not agree(int(problem is not None)):
                return base
            old = self.store.outer_meta_if_readable(base) if self.process == 0 else None
            if self.process == 0:
                aside = self.store.set_aside_outer(base)
                say(f"{problem} Moved it aside to {aside}; going on from the outer state "
                    f"before it and the committed gradients of the rounds after that")
            self.damaged[base] = old

    def _wait_for_outer(self, latest: int) -> int:
        deadline = time.monotonic() + self.job.deadline + 60
        while time.monotonic() < deadline:
            found = self._intact_base(latest)
            if found is not None:
                return found
            time.sleep(POLL)
        raise StoreError(f"{self.store.root} has closed rounds but no committed outer state "
                         f"to join from after {self.job.deadline + 60:.0f} s.")
