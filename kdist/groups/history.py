"""The replica groups' part of ``kdist report``: a group's rounds from its throughput log,
and the whole job from its store (rounds and their members, failures, rejoins, the end).

Example:
    >>> rows = [{"kind": "interval", "rounds": [
    ...     {"round": 1, "members": [0, 1], "seconds": 0.2, "waited": 0.1, "behind": False}]}]
    >>> print(round_lines(rows)[0])  # doctest: +NORMALIZE_WHITESPACE
    replica rounds: 1 (this group in 1, behind 0 times); per round 0.20 s on the host
    median, 0.10 s waiting for the quorum median / 0.10 s max
"""

from __future__ import annotations

import collections
import statistics
from pathlib import Path


def round_lines(rows: list[dict]) -> list[str]:
    """One line on the rounds a group's interval rows carry (none: no lines)."""
    entries = [e for r in rows if r.get("kind") == "interval" for e in r.get("rounds", [])]
    rounds = [e for e in entries if "round" in e]
    if not rounds:
        return []
    took_part = [e for e in rounds if e.get("group") in e["members"] or
                 ("group" not in e and e["members"])]
    behind = sum(bool(e.get("behind")) for e in rounds)
    waited = [e.get("waited", 0.0) for e in rounds]
    line = (f"replica rounds: {len(rounds)} (this group in {len(took_part)}, behind {behind} "
            f"times); per round {statistics.median(e['seconds'] for e in rounds):.2f} s on "
            f"the host median, {statistics.median(waited):.2f} s waiting for the quorum "
            f"median / {max(waited):.2f} s max")
    joins = [e["join"] for e in entries if "join" in e]
    return [line] + ([f"joined the job at round {', '.join(map(str, joins))}"] if joins else [])


def job_lines(store_dir: str | Path) -> list[str]:
    """What the job in ``store_dir`` did: its rounds, who took part, each failure with the
    round it happened in, what replaced the group and when it rejoined, how it ended."""
    import json

    from kdist.groups.store import describe

    found = describe(store_dir)
    manifest = found["manifest"] or {}
    groups = (manifest.get("fingerprint") or {}).get("groups")
    rounds = found["rounds"]
    lines = [f"replica groups: {groups} groups, {len(rounds)} rounds closed "
             f"(newest {max(rounds, default=0)}), outer state of round {found['outer']} "
             f"durable in {Path(store_dir) / 'outer'}"]
    sizes = collections.Counter(len(q["members"]) for q in rounds.values())
    if sizes:
        lines.append("members per round: " + ", ".join(
            f"{n} groups in {k} rounds" for n, k in sorted(sizes.items(), reverse=True)))
        waits = [q.get("waited", 0.0) for q in rounds.values()]
        lines.append(f"closing a round: {statistics.median(waits):.2f} s median, "
                     f"{max(waits):.2f} s max after the proposer published")
    events_file = Path(store_dir) / "events.jsonl"
    events = ([json.loads(x) for x in events_file.read_text().splitlines() if x.strip()]
              if events_file.is_file() else [])
    joins = found["joins"]
    for e in events:
        if e.get("event") == "failure":
            back = next((j for j in joins if j["group"] == e["group"] and j["time"] > e["time"]),
                        None)
            again = (f", rejoined at round {back['round']} after {back['time'] - e['time']:.1f} s"
                     if back else ", did not rejoin")
            if back and back.get("step") is not None and back.get("job_step") is not None:
                again += f", {back['job_step'] - back['step']} steps behind the job's step"
            lines.append(f"failure: group {e['group']} at round {e.get('round')} (status "
                         f"{e.get('status')}): {e.get('action')}{again}")
        elif e.get("event") in ("refused", "job failed", "job done"):
            lines.append(f"{e['event']}: " + ", ".join(
                f"{k} {v}" for k, v in e.items() if k not in ("event", "time")))
    return lines
