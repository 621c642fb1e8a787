"""Which parallelism features combine: one table, as data.

A *feature* is a mesh axis of size > 1 (``data``, ``fsdp``, ``model``, ``stage``, ``seq``,
``replica``, ``expert``) or kdist's gradient exchange (``reduction``: float32/bfloat16 sums;
``8-bit``: float8/int8 codes). Every pair of features has one :class:`Rule`: built (with a
caveat the README's matrix shows), or refused with the reason and what to use instead.
:func:`check` refuses a configuration containing a refused pair — the only place that does;
the planner's search (:mod:`kdist.planning.search`), the recipes' flags, the README's
matrix and the tests read the same table.

Example:
    >>> rule("stage", "fsdp").built
    True
    >>> check({"fsdp", "model"}, "fsdp=4,model=2")  # every pair built: no error
"""

from __future__ import annotations

import dataclasses
import itertools

FEATURES = {
    "data": "replicas holding whole weights (data parallel)",
    "fsdp": "replicas holding a shard of every weight (ZeRO-3)",
    "model": "tensor parallelism",
    "stage": "pipeline stages",
    "seq": "context parallelism (each sequence's tokens split)",
    "replica": "DiLoCo replica groups (sync_every)",
    "expert": "Mixture-of-Experts experts split, tokens dispatched by all-to-all "
              "(kdist.parallel.experts)",
    "reduction": "kdist's gradient reduction (gradient_reduction='float32'/'bfloat16')",
    "8-bit": "8-bit gradient codes (gradient_reduction='float8'/'int8')",
    "schedule": "a pipeline schedule run by kdist.parallel.pipeline.interpreter "
                "(pipeline_schedule='1f1b'/'interleaved_1f1b'/'zero_bubble')",
    "zero_bubble": "the zero-bubble schedule, whose ticks mix kinds of task",
    "ring": "ring attention over 'seq' (context_parallel='ring')",
}
# Variants of a feature: a pair holding one takes its feature's rule unless the table has a
# rule of its own for it (and a variant is built with its own feature).
VARIANTS = {"zero_bubble": "schedule", "ring": "seq"}
# The README's matrix: these rows against every axis.
MATRIX_ROWS = ("stage", "seq", "replica", "reduction", "8-bit", "schedule")
MATRIX_COLUMNS = ("data", "fsdp", "model", "stage", "seq", "replica")


@dataclasses.dataclass(frozen=True)
class Rule:
    """How two features combine. ``note``: for a built pair, a caveat (shown in the
    matrix); for a refused one, why and what to use instead (the error's text)."""

    a: str
    b: str
    built: bool
    note: str = ""


def _built(a, b, note=""):
    return Rule(a, b, True, note)


def refused(a, b, note):
    """A pair that does not combine; ``note`` names why and what to use instead, with
    ``{a}`` / ``{b}`` for the two features' descriptions."""
    return Rule(a, b, False, note)

RULES: tuple[Rule, ...] = (
    _built("data", "fsdp"), _built("data", "model"), _built("fsdp", "model"),
    _built("stage", "data"), _built("stage", "fsdp"),
    _built("stage", "model", "XLA inside the stage"),
    _built("seq", "data"), _built("seq", "fsdp"), _built("seq", "model"),
    _built("replica", "data"), _built("replica", "fsdp"), _built("replica", "model"),
    _built("stage", "seq", "tokens split in every stage"),
    _built("stage", "replica", "a pipeline per group"),
    _built("seq", "replica", "causal LMs, no dropout"),
    _built("reduction", "data"), _built("reduction", "fsdp"), _built("reduction", "model"),
    _built("reduction", "stage"),
    _built("reduction", "seq", "causal LMs, no dropout"),
    _built("reduction", "replica", "nested"),
    _built("8-bit", "data"), _built("8-bit", "fsdp"), _built("8-bit", "model"),
    _built("8-bit", "stage"),
    _built("8-bit", "seq", "causal LMs, no dropout"),
    _built("8-bit", "replica", "nested"),
    # The interpreter's shard_map is manual over stage, data, fsdp and seq, model automatic;
    # nested in a replica group's region (DiLoCo) or kdist's per-device loss (reduction),
    # it takes the axes still automatic.
    _built("schedule", "stage"), _built("schedule", "data"), _built("schedule", "fsdp"),
    _built("schedule", "model", "XLA inside the stage"),
    _built("schedule", "replica", "a schedule per group"),
    _built("schedule", "reduction", "nested"), _built("schedule", "8-bit", "nested"),
    _built("schedule", "seq", "causal LMs; ring attention not with zero-bubble"),
    # Ring attention's collective-permutes over seq need every stage to run the same code
    # in every tick (kdist.parallel.pipeline.every_stage).
    # The expert axis: the MoE layers' all-to-all inside a shard_map manual over the batch's
    # axes and 'seq' (kdist.parallel.experts); 'model' stays XLA's.
    _built("expert", "data"), _built("expert", "fsdp"),
    _built("expert", "model"),
    _built("expert", "seq", "tokens enter the experts' region as their sequences lie"),
    _built("expert", "replica", "the experts' region nested in each group's"),
    _built("expert", "stage", "each microbatch routes its own tokens"),
    _built("expert", "reduction", "expert weights whole in the per-device loss"),
    _built("expert", "8-bit", "expert weights whole in the per-device loss"),
    _built("expert", "schedule", "each microbatch routes its own tokens"),
    refused("zero_bubble", "ring",
            "runs ticks that mix forwards, input gradients and weight gradients, so its "
            "stages cannot all run the exchanges of {b} between 'seq' neighbours in every "
            "tick. "
            "Use pipeline_schedule='1f1b' or 'interleaved_1f1b' with ring attention, or "
            "context_parallel='all_gather' with zero_bubble."),
)


def _by_pair(rules) -> dict[frozenset, Rule]:
    """The table by pair; a pair twice, or a feature not in :data:`FEATURES`, is an error
    naming it (the table is data: checked where it is read, not with ``assert``)."""
    table = {}
    for r in rules:
        unknown = {r.a, r.b} - set(FEATURES)
        if unknown:
            raise RuntimeError(f"The combination table's rule {r.a} x {r.b} names unknown "
                               f"features {sorted(unknown)}; known: {sorted(FEATURES)}.")
        pair = frozenset((r.a, r.b))
        if pair in table:
            raise RuntimeError(f"The combination table has {r.a} x {r.b} twice.")
        table[pair] = r
    return table


_BY_PAIR = _by_pair(RULES)


def rule(a: str, b: str, rules: tuple[Rule, ...] | None = None) -> Rule:
    """The rule for two features (``reduction`` and ``8-bit`` exclude each other: they are
    one setting, never a pair), from :data:`RULES` (or ``rules``); a variant's
    (:data:`VARIANTS`) is its feature's unless the table has its own."""
    for f in (a, b):
        if f not in FEATURES:
            raise ValueError(f"Unknown feature {f!r}; known: {sorted(FEATURES)}.")
    table = _BY_PAIR if rules is None else _by_pair(rules)
    found = table.get(frozenset((a, b)))
    if found is None and (a in VARIANTS or b in VARIANTS):
        a, b = VARIANTS.get(a, a), VARIANTS.get(b, b)
        found = Rule(a, b, True) if a == b else table.get(frozenset((a, b)))
    if found is None:
        raise ValueError(f"The combination table has no rule for {a} x {b}.")
    return found


def _describe(feature: str) -> str:
    return {"reduction": "gradient_reduction='float32'/'bfloat16'",
            "8-bit": "gradient_reduction='float8'/'int8'",
            "schedule": "pipeline_schedule='1f1b'/'interleaved_1f1b'/'zero_bubble'",
            "zero_bubble": "pipeline_schedule='zero_bubble'",
            "ring": "ring attention (context_parallel='ring')",
            "replica": "DiLoCo replica groups (sync_every)"}.get(feature, f"the '{feature}' axis")


def check(features, spec: str, rules: tuple[Rule, ...] | None = None) -> None:
    """Raises ``ValueError`` for the first refused pair among ``features`` (a set of
    :data:`FEATURES` names), with the table's reason, naming the mesh spec and argument.
    ``rules``: another table than :data:`RULES` (for tests)."""
    for a, b in itertools.combinations(sorted(features), 2):
        r = rule(a, b, rules)
        if not r.built:
            first, second = (r.a, r.b)
            reason = r.note.format(a=_describe(first), b=_describe(second))
            raise ValueError(f"Mesh spec {spec!r}: {_describe(first)} {reason}")


def matrix() -> dict[tuple[str, str], Rule]:
    """``(row, column) -> Rule`` for the README's matrix (rows :data:`MATRIX_ROWS`,
    columns :data:`MATRIX_COLUMNS`; a feature against itself is left out)."""
    return {(r, c): rule(r, c) for r in MATRIX_ROWS for c in MATRIX_COLUMNS if r != c}
