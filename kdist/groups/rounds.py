"""What each outer round cost a group, as the throughput log's interval rows show it.

:class:`kdist.groups.sync.OuterSync` appends one entry per round (its index, the members,
seconds on the host, seconds waited for the quorum, whether the group was behind) and one
per join; :class:`kdist.callbacks.Throughput` adds those since its last row to each interval
row (``"rounds"``), and ``kdist report`` summarises them.

Example:
    >>> class Groups: outer = None
    >>> interval_rounds(Groups())
    {}
"""

from __future__ import annotations


def interval_rounds(groups) -> dict:
    """``{"rounds": [...]}``: the entries since the last call (none without separate group
    jobs: an empty dict)."""
    outer = getattr(groups, "outer", None)
    if outer is None:
        return {}
    new = outer.rounds[outer.reported:]
    outer.reported += len(new)
    return {"rounds": new}
