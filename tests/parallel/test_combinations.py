"""Every row of the combination table (tests/parallel/combinations.py): a combination kdist
builds trains like one device for each of its families (tests/parallel/harness.py); one it
refuses fails with its message, before anything compiles. The README's combination matrix
says what the table shows, cell for cell."""

import re

import jax
import pytest

import kdist
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


@pytest.mark.parametrize("row", REFUSED)
def test_is_refused_before_compiling(row: Row):
    with pytest.raises(ValueError, match=row.refusal):
        kdist.distribution(row.mesh, **row.options)


# --- the README's matrix -------------------------------------------------------------------

COLUMNS = ("data", "fsdp", "model", "stage", "seq", "replica")


def concepts(row: Row) -> set[str]:
    """The axes a row's mesh uses (size > 1; DiLoCo's ``replica`` also with one group) and
    the gradient exchange it asks for."""
    sizes = parse_mesh(row.mesh, row.run.get("devices", 8))
    found = {axis for axis, size in sizes.items() if size > 1}
    if row.options.get("sync_every"):
        found.add("replica")
    reduction = row.options.get("gradient_reduction")
    if reduction in ("float32", "bfloat16"):
        found.add("reduction")
    elif reduction in ("float8", "int8"):
        found.add("8-bit")
    return found


def table_matrix() -> dict[tuple[str, str], set[str]]:
    """(concept, column) -> what the table's rows show there: 'trains' and/or 'refused'.
    A refused row shows 'refused' for its one new pair (named by ``refuses``)."""
    cells: dict[tuple[str, str], set[str]] = {}
    for row in TABLE:
        found = concepts(row)
        if row.refusal is None:
            pairs = {(a, b) for a in found for b in found if a != b}
            outcome = "trains"
        else:
            a, b = row.refuses
            assert {a, b} <= found, (row.id, row.refuses, found)
            pairs, outcome = {(a, b), (b, a)}, "refused"
        for pair in pairs:
            cells.setdefault(pair, set()).add(outcome)
    return cells


def readme_matrix() -> dict[tuple[str, str], str]:
    text = (ROOT / "README.md").read_text()
    header = "| | " + " | ".join(COLUMNS) + " |"
    assert header in text, f"the README's combination matrix must start with {header!r}"
    lines = text[text.index(header):].splitlines()[2:]
    cells = {}
    for line in lines:
        if not line.startswith("|"):
            break
        label, *values = [c.strip() for c in line.strip("|").split("|")]
        concept = {"explicit": "reduction"}.get(label.split()[0], label.split()[0])
        assert len(values) == len(COLUMNS), line
        for column, value in zip(COLUMNS, values):
            if value:
                cells[(concept, column)] = ("trains" if value.startswith("✓") else
                                            "refused" if value.startswith("refused") else value)
    return cells


def test_the_readme_matrix_is_the_tables():
    table, readme = table_matrix(), readme_matrix()
    assert readme, "no cells read from the README's matrix"
    for (concept, column), said in readme.items():
        shown = table.get((concept, column), set())
        assert shown == {said}, (
            f"README says {concept} x {column}: {said}; the table's rows show "
            f"{sorted(shown) or 'nothing'} (tests/parallel/combinations.py)")
    for concept in {c for c, _ in readme}:
        for column in COLUMNS:
            if (concept, column) in table and concept != column:
                assert (concept, column) in readme, (
                    f"the table shows {concept} x {column} but the README's matrix is silent")


def test_every_refusal_names_the_argument():
    for row in TABLE:
        if row.refusal is None:
            continue
        with pytest.raises(ValueError) as error:
            kdist.distribution(row.mesh, **row.options)
        message = str(error.value)
        named = [*row.options, "mesh"]
        assert any(re.search(rf"\b{k}\b", message, re.I) for k in named), (row.id, message)
