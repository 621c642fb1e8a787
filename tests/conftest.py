"""Test harness: 8 forced host devices, JAX backend, a fresh Keras state per test, and one
compilation per distinct program per run.

The suite's time is a budget (25 minutes on 2 cores, CI included). What keeps it: XLA:CPU
flags that compile for compile time (tests/xla_flags.py), programs lowered with the user's
frame as each op's location instead of its whole traceback (below), Python's collector
kept off what outlives a test (``gc.freeze``, below), the caches below, one harness for
every parity test (tests/parallel/harness.py) and one multi-process launch
(``multihost_cases``). A module-scoped fixture that trains runs once per xdist worker that
needs it: the tests that share one carry ``@pytest.mark.xdist_group(<its name>)``, so they
go to one worker and it trains once (seen: the composed checkpoint's three fits ran on
both workers, 35 s twice).
``KDIST_TEST_CPU_LOG=FILE`` appends each test's CPU seconds (its worker's and its child
processes') to FILE as JSON lines: where the budget goes, unlike ``--durations``' wall
times, which a loaded machine inflates.

Caches (both in ``.cache/`` of the checkout, ignored by git, inherited by every child
process through the environment; delete the folder to start cold — the suite passes either
way):

- JAX's persistent compilation cache (``.cache/jax``, every program, however quickly it
  compiled). JAX keys an entry by a SHA-256 over the StableHLO module with its debug
  locations stripped, the jaxlib and backend versions, ``XLA_FLAGS``, the serialized
  compile options (device assignment included) and the devices' kinds
  (``jax._src.cache_key.get``): a program that changes in any op, shape, constant or
  sharding gets a new key; only the identical program is loaded instead of compiled.
- kdist's tokenizer and token-store cache (``$KDIST_CACHE``) in a folder named after a hash
  of ``kdist/data/``'s sources: a change to the data code trains and packs afresh.
"""

import hashlib
import os
from pathlib import Path

from tests.xla_flags import FAST_COMPILE

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"


def _data_code_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted((ROOT / "kdist" / "data").rglob("*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KDIST_CACHE", str(CACHE / f"kdist-test-{_data_code_hash()}"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Compile for compile time, not run time (tests/xla_flags.py says why and what changes).
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
# Each op's location in a lowered program: the frame of the user's code that made it, not
# JAX's default of its whole Python traceback (Keras' call stacks run 40+ frames deep, and
# XLA carries every frame into the program's metadata). The ops and the cache key (which
# strips locations) are unchanged; what changes is debug metadata: stack frames, and the
# HLO op_name of an op inside a shard_map, which loses its enclosing scopes ("shard_map/
# all_to_all", not "jit(train_step)/.../block_0/shard_map/all_to_all"). A test that reads
# op names takes the ``full_locations`` fixture (JAX's default). Measured cold, the whole
# suite on 2 cores: CPU 2945 -> 2581 s (children included); 5 parity rows 40.5 -> 38.9 s.
os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "false")

import kdist  # noqa: E402

# 8 CPU devices, with the XLA:CPU settings that keep their collectives from stalling
# (kdist/parallel/devices.py); before anything starts JAX's backends.
kdist.force_host_devices(8)

import gc  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import keras  # noqa: E402
import pytest  # noqa: E402

from tests.helpers import child_environment  # noqa: E402

# Python's collector and the suite: Keras' clear_session() runs gc.collect(), twice a test
# here and in every harness run, and a full collection scans every object the process
# holds: ~450,000 after the imports (0.22 s), millions once a worker has traced hundreds of
# programs (2.4 s late in a run, where a test that compiles nothing took 5 s). So what the
# imports made is frozen (out of the collector's reach: it lives as long as the process),
# and after each test what survived its clean-up is too; a collection then scans only what
# the current test made. Every FULL_SWEEP tests a full collection frees whatever frozen
# objects have become garbage since, so nothing accumulates.
FULL_SWEEP = 50
gc.collect()
gc.freeze()
_tests_since_sweep = 0


def _freeze_survivors() -> None:
    global _tests_since_sweep
    _tests_since_sweep += 1
    if _tests_since_sweep >= FULL_SWEEP:
        _tests_since_sweep = 0
        gc.unfreeze()
        gc.collect()
    gc.freeze()


def pytest_sessionstart(session):
    if jax.device_count() != 8:
        raise RuntimeError(
            f"The tests need 8 host devices but JAX sees {jax.device_count()}: jax was imported "
            f"before tests/conftest.py set XLA_FLAGS."
        )
    if jax.config.jax_compilation_cache_dir != os.environ["JAX_COMPILATION_CACHE_DIR"]:
        raise RuntimeError("JAX did not take the compilation cache folder of tests/conftest.py")


def pytest_collection_modifyitems(config, items):
    # Under pytest-xdist (make test: --dist loadgroup) the tests reading the one
    # multi-process launch must run on one worker, which launches it once: each carries the
    # mark itself (xdist reads marks before conftest hooks could add them).
    unmarked = [item.nodeid for item in items
                if "multihost_cases" in getattr(item, "fixturenames", ())
                and not any(m.args == ("multihost",) for m in item.iter_markers("xdist_group"))]
    if unmarked:
        raise pytest.UsageError(f'Mark these @pytest.mark.xdist_group("multihost"): {unmarked}')
    # The long tests first (the multi-process launch, then those marked slow): xdist hands
    # out tests in this order, so the run does not end with one worker on a 2-minute test
    # while the other idles. A stable sort: the rest keep their order.
    def rank(item):
        multihost = any(m.args == ("multihost",) for m in item.iter_markers("xdist_group"))
        return 0 if multihost else 1 if item.get_closest_marker("slow") else 2

    items.sort(key=rank)


CPU_LOG = os.environ.get("KDIST_TEST_CPU_LOG")


def _cpu_seconds() -> tuple[float, float]:
    """This process's CPU seconds and its finished children's (user + system)."""
    own, children = (resource.getrusage(who) for who in
                     (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not CPU_LOG:
        yield
        return
    own, children, start = *_cpu_seconds(), time.perf_counter()
    yield  # setup, call and teardown: a module fixture counts in the test that made it
    own_after, children_after = _cpu_seconds()
    record = {"test": item.nodeid, "cpu": round(own_after - own, 2),
              "children_cpu": round(children_after - children, 2),
              "wall": round(time.perf_counter() - start, 2), "worker": os.getpid()}
    with open(CPU_LOG, "a") as log:  # one short append per line: workers do not interleave
        log.write(json.dumps(record) + "\n")


@pytest.fixture(scope="session", autouse=True)
def shared_runs_folder(tmp_path_factory):
    """Where the parity harness' reference runs are shared by this session's processes
    (tests/parallel/shared_runs.py): in the session's temporary folder, which an xdist
    worker's is a folder of (pytest keeps the last three sessions' and removes older ones)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs"
    os.environ["KDIST_TEST_SHARED_RUNS"] = str(folder)
    return folder


@pytest.fixture(autouse=True)
def fresh_keras_state():
    """Each test starts with no distribution, float32 and no remat scope, and a fixed seed."""
    keras.utils.clear_session()
    keras.distribution.set_distribution(None)
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)
    yield
    keras.distribution.set_distribution(None)
    keras.config.set_dtype_policy("float32")
    keras.utils.clear_session()
    _freeze_survivors()


def _become_child_environment(patch: pytest.MonkeyPatch) -> None:
    """Makes ``os.environ`` the environment every child process starts from
    (:func:`tests.helpers.child_environment`), for code that spawns from it
    (``kdist.launch.launch``)."""
    env = child_environment()
    for name in set(os.environ) - set(env):
        patch.delenv(name)
    for name, value in env.items():
        patch.setenv(name, value)


@pytest.fixture
def full_locations():
    """JAX's default op locations (whole tracebacks) for a test that reads HLO op names,
    which XLA derives from them; the suite lowers user frames only (top of this file)."""
    previous = jax.config.jax_include_full_tracebacks_in_locations
    jax.config.update("jax_include_full_tracebacks_in_locations", True)
    yield
    jax.config.update("jax_include_full_tracebacks_in_locations", previous)


@pytest.fixture
def child_env(monkeypatch):
    """``os.environ`` as a child process's, for the test (see _become_child_environment)."""
    _become_child_environment(monkeypatch)


class MultihostCases:
    """What tests/multihost_script.py's ``batch`` wrote: each case's per-rank results."""

    def __init__(self, root, status: int, output: str):
        self.root, self.status, self.output = root, status, output

    def out(self, name: str):
        from tests import multihost_script

        return self.root / multihost_script.slug(name)

    def ranks(self, name: str, processes: int = 2) -> list[dict]:
        import json

        assert self.status == 0, f"the launch ended with status {self.status}:\n" + (
            self.output[-6000:])
        command = name.split()[0]
        files = [self.out(name) / f"{command}-rank{r}.json" for r in range(processes)]
        missing = [f.name for f in files if not f.is_file()]
        assert not missing, (f"case {name!r} wrote no {missing} (launch status "
                             f"{self.status}):\n{self.output[-6000:]}")
        return [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="session")
def multihost_cases(tmp_path_factory):
    """Every case of tests/multihost_script.py's ``CASES``, run once per session by one
    ``kdist.launch`` of 2 processes x 4 host devices (the imports and the cluster's start-up
    paid once); tests read each case's results with ``.ranks(name)``."""
    import contextlib
    import io
    import sys

    from kdist import launch
    from tests.models.hf_fixtures import write_checkpoint

    root = tmp_path_factory.mktemp("multihost")
    write_checkpoint(root / "hf-source", "gpt2")  # the "hf" cases' checkpoint
    output = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(output):
        _become_child_environment(patch)
        status = launch.launch([sys.executable, str(ROOT / "tests" / "multihost_script.py"),
                                "batch", "--out", str(root)], processes=2, devices_per_process=4)
    return MultihostCases(root, status, output.getvalue())
