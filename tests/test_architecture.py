"""The package's shape: small modules, no import cycles, private Keras/JAX API in one place,
no import-time side effects."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_environment

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kdist"
MAX_LINES = 460  # "no module above ~450 lines"
COMPAT = "kdist._keras_compat"


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imported_modules(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """kdist modules ``name`` imports anywhere in its body (functions included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


def test_no_module_is_too_long():
    long = {n: len(p.read_text().splitlines()) for n, p in modules().items()}
    long = {n: k for n, k in long.items() if k > MAX_LINES}
    assert not long, f"modules above {MAX_LINES} lines: {long}"


def test_the_import_graph_has_no_cycle():
    known = modules()
    assert_acyclic({n: imported_modules(n, p, known) for n, p in known.items()}, "import")


def assert_acyclic(graph: dict[str, set[str]], what: str) -> None:
    """Fails naming the first cycle of ``graph`` (node -> the nodes it imports)."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError(f"{what} cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def private_uses(path: Path) -> list[str]:
    """Private Keras/JAX API, or another module's private name, used in ``path``."""
    text = path.read_text()
    tree = ast.parse(text)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [getattr(node, "module", None) or ""] + [a.name for a in node.names]
            if any(n.startswith(("keras.src", "jax._src", "keras_hub.src")) for n in names):
                found.append(f"line {node.lineno}: imports {names}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kdist"):
                private = [a.name for a in node.names
                           if a.name.startswith("_") and a.name != "_keras_compat"]
                if private:
                    found.append(f"line {node.lineno}: imports private {private} "
                                 f"from {node.module}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls", "_keras_compat"):
                continue
            if isinstance(owner, ast.Name) and (owner.id, node.attr) == ("os", "_exit"):
                continue  # documented Python API
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) \
                    and owner.func.id == "super":
                continue  # an override calling its base class
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_private_keras_and_jax_api_only_in_the_compatibility_module():
    offenders = {}
    for name, path in modules().items():
        if name == COMPAT:
            continue
        uses = private_uses(path)
        if uses:
            offenders[name] = uses
    assert not offenders, (
        "private API outside kdist/_keras_compat.py (move it there, with the version it was "
        f"checked against): {json.dumps(offenders, indent=1)}")


def keras_private_names() -> set[str]:
    """Private attributes of the Keras classes kdist subclasses (class and instance ones)."""
    import keras
    import numpy as np

    names = set()
    for cls in (keras.Model, keras.layers.Layer, keras.layers.ReversibleEmbedding,
                keras.callbacks.Callback, keras.optimizers.AdamW, keras.Variable,
                keras.utils.PyDataset):
        names.update(dir(cls))
    model = keras.Sequential([keras.layers.Dense(2)])
    model.compile(optimizer="adamw", loss="mse")
    model.fit(np.ones((2, 3)), np.ones((2, 2)), verbose=0)
    for obj in (model, model.layers[0], model.optimizer, keras.callbacks.Callback(),
                model.layers[0].kernel):
        names.update(vars(obj))
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_private_keras_attribute_is_used_through_self():
    """``self._x`` where ``_x`` is Keras' (a base class's private method or attribute) is
    private API too, unless the module defines ``_x`` itself."""
    keras_names = keras_private_names()
    offenders = {}
    for name, path in modules().items():
        if name == COMPAT:
            continue
        tree = ast.parse(path.read_text())
        own = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
        used = {node.attr for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "self" and node.attr in keras_names}
        if used - own:
            offenders[name] = sorted(used - own)
    assert not offenders, f"Keras-private attributes used outside the compat module: {offenders}"


@pytest.mark.parametrize("xla_flags", [None, "--xla_force_host_platform_device_count=4"])
def test_import_kdist_leaves_the_environment_unchanged(xla_flags):
    env = {k: v for k, v in child_environment(KERAS_BACKEND="jax").items()
           if k not in ("XLA_FLAGS", "NPROC")}
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    code = ("import json, os; before = dict(os.environ); import kdist; "
            "print(json.dumps([before, dict(os.environ)]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    before, after = json.loads(out.stdout.strip().splitlines()[-1])
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    assert not changed, f"import kdist changed {sorted(changed)}"


def test_every_module_is_on_its_packages_map():
    """A package's ``__init__`` docstring is its map: every module and subpackage in it is
    named there (as ``name``, ``.name`` or :mod:`...name`), so the map cannot rot."""
    unnamed = {}
    for init in sorted(PACKAGE.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        named = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", doc))
        parts = [p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py"]
        parts += [p.name for p in init.parent.iterdir() if (p / "__init__.py").exists()]
        missing = sorted(set(parts) - named)
        if missing:
            unnamed[str(init.relative_to(ROOT))] = missing
    assert not unnamed, f"modules missing from their package's map: {unnamed}"


def test_no_step_state_is_set_on_the_model():
    """The training step's transforms take what they need from the task's parts: no hidden
    targets set on a model to run a step, and no loss returned as a prediction."""
    found = [f"{p.relative_to(ROOT)}: {name}" for p in PACKAGE.rglob("*.py")
             for name in ("_pipeline_targets", "pipeline_loss_for", "self.in_schedule(")
             if name in p.read_text()]
    assert not found, found


def test_the_packages_import_one_way():
    """No cycle between kdist's packages (a top-level module counts as its own): e.g.
    ``parallel`` never imports ``groups``, which builds DiLoCo on it."""
    known = modules()

    def package(name):
        parts = name.split(".")
        return ".".join(parts[:2])

    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        graph.setdefault(package(name), set()).update(
            package(m) for m in imported_modules(name, path, known) if package(m) != package(name)
            and package(m) != "kdist")
    assert_acyclic(graph, "package")
