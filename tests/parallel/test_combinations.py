"""Every row of the combination table (tests/parallel/combinations.py): a combination kdist
builds trains like one device for each of its families (tests/parallel/harness.py); one it
refuses fails with its message, before anything compiles. The README's combination matrix
is kdist's combination table (kdist/parallel/combinations.py), and every cell of it is
shown by rows here: a built pair trains, a refused pair is refused."""

import re

import jax
import pytest

import kdist
from kdist.parallel import combinations
from kdist.parallel.mesh import parse_mesh
from tests.helpers import ROOT
from tests.parallel.combinations import TABLE, Row
from tests.parallel.harness import assert_trains_like_one_device

TRAINS = [pytest.param(row, family, id=f"{row.id}-{family}",
                       marks=[pytest.mark.slow] if row.run.get("slow") else [])
          for row in TABLE if row.refusal is None for family in row.families]
REFUSED = [pytest.param(row, id=row.id) for row in TABLE if row.refusal is not None]


@pytest.mark.parametrize("row, family", TRAINS)
def test_trains_like_one_device(row: Row, family: str):
    settings = row.settings()
    if "devices" in settings:
        settings["devices"] = jax.devices()[:settings["devices"]]
    assert_trains_like_one_device(family, row.mesh, **settings)


if REFUSED:  # the schedule's refused pairs (kdist.parallel.combinations)
    @pytest.mark.parametrize("row", REFUSED)
    def test_is_refused_before_compiling(row: Row):
        with pytest.raises(ValueError, match=row.refusal):
            kdist.distribution(row.mesh, **row.options)

    def test_every_refusal_of_the_rows_names_the_argument():
        for row in TABLE:
            if row.refusal is None:
                continue
            with pytest.raises(ValueError) as error:
                kdist.distribution(row.mesh, **row.options)
            message = str(error.value)
            named = [*row.options, "mesh"]
            assert any(re.search(rf"\b{k}\b", message, re.I) for k in named), (row.id, message)


def test_a_refused_pair_is_an_error_naming_the_mesh_and_the_fix():
    """kdist.distribution refuses through combinations.check; with a table that refuses
    stage x seq, a spec holding both is refused with the rule's reason."""
    table = tuple(r for r in combinations.RULES if {r.a, r.b} != {"stage", "seq"}) + (
        combinations.refused("stage", "seq", "is not built with {b}; put those devices on "
                                             "data instead"),)
    with pytest.raises(ValueError, match=r"Mesh spec 'stage=2,seq=2,fsdp=2': the 'stage' axis "
                                         r"is not built with the 'seq' axis; put those"):
        combinations.check({"stage", "seq", "fsdp"}, "stage=2,seq=2,fsdp=2", table)
    combinations.check({"stage", "fsdp"}, "stage=2,fsdp=4", table)  # the others still pass


# --- kdist's combination table, the README's matrix and the rows above ---------------------


def concepts(row: Row) -> set[str]:
    """The features of a row (kdist.parallel.combinations.FEATURES): the axes its mesh
    uses (size > 1), "replica" for DiLoCo (also with one group), its gradient exchange."""
    return set(kdist.distribution(row.mesh, jax.devices()[:row.run.get("devices", 8)],
                                  **row.options).config.features) if row.refusal is None \
        else _refused_concepts(row)


def _refused_concepts(row: Row) -> set[str]:
    sizes = parse_mesh(row.mesh, row.run.get("devices", 8))
    found = {axis for axis, size in sizes.items() if size > 1}
    if row.options.get("sync_every"):
        found.add("replica")
    reduction = row.options.get("gradient_reduction")
    if reduction:
        found.add("8-bit" if reduction in ("float8", "int8") else "reduction")
    if row.options.get("pipeline_schedule", "gpipe") != "gpipe":
        found.add("schedule")
    if row.options.get("pipeline_schedule") == "zero_bubble":
        found.add("zero_bubble")
    if row.options.get("context_parallel") == "ring":
        found.add("ring")
    return found


def shown_by_rows() -> dict[tuple[str, str], set[str]]:
    """(feature, feature) -> what the rows show there: "trains" and/or "refused". A
    refused row shows its one pair (``refuses``), a training row every pair it holds."""
    cells: dict[tuple[str, str], set[str]] = {}
    for row in TABLE:
        found = concepts(row)
        if row.refusal is None:
            pairs, outcome = {(a, b) for a in found for b in found if a != b}, "trains"
        else:
            a, b = row.refuses
            assert {a, b} <= found, (row.id, row.refuses, found)
            pairs, outcome = {(a, b), (b, a)}, "refused"
        for pair in pairs:
            cells.setdefault(pair, set()).add(outcome)
    return cells


def readme_matrix() -> dict[tuple[str, str], str]:
    """(row, column) -> the README cell's text."""
    text = (ROOT / "README.md").read_text()
    header = "| | " + " | ".join(combinations.MATRIX_COLUMNS) + " |"
    assert header in text, f"the README's combination matrix must start with {header!r}"
    cells = {}
    for line in text[text.index(header):].splitlines()[2:]:
        if not line.startswith("|"):
            break
        label, *values = [c.strip() for c in line.strip("|").split("|")]
        row = {"explicit": "reduction"}.get(label.split()[0], label.split()[0])
        assert len(values) == len(combinations.MATRIX_COLUMNS), line
        for column, value in zip(combinations.MATRIX_COLUMNS, values):
            if row != column:
                cells[(row, column)] = value
    return cells


def test_the_readme_matrix_is_kdists_combination_table():
    readme = readme_matrix()
    for (row, column), rule in combinations.matrix().items():
        want = ("✓" + (f" ({rule.note})" if rule.note else "")) if rule.built else "refused"
        assert readme.get((row, column)) == want, (
            f"README's matrix says {row} x {column}: {readme.get((row, column))!r}; "
            f"kdist/parallel/combinations.py says {want!r}")
    assert set(readme) == set(combinations.matrix())


def test_every_cell_of_the_table_is_shown_by_a_row():
    shown = shown_by_rows()
    for (row, column), rule in combinations.matrix().items():
        want = "trains" if rule.built else "refused"
        assert shown.get((row, column)) == {want}, (
            f"{row} x {column} is {'built' if rule.built else 'refused'} in "
            f"kdist/parallel/combinations.py, but tests/parallel/combinations.py's rows show "
            f"{sorted(shown.get((row, column), ())) or 'nothing'}")
