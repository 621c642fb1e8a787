"""The parity harness itself (tests/parallel/harness.py): runs are deterministic, and a
training that differs from one device's fails it. Every strategy's parity tests are rows
of tests/parallel/combinations.py, run by tests/parallel/test_combinations.py."""

import pytest

from tests.parallel import harness


def test_same_seed_same_losses():
    first = harness.train_run("gpt", "data=2,fsdp=2,model=2")
    second = harness.train_run("gpt", "data=2,fsdp=2,model=2")
    assert first.losses == second.losses


def test_a_run_that_differs_from_one_device_fails(monkeypatch):
    # Another initialisation of the sharded model than of the reference: caught before
    # the losses are compared.
    train_run = harness.train_run
    monkeypatch.setattr(harness, "train_run", lambda family, mesh=None, **kw: train_run(
        family, mesh, **{**kw, "seed": kw["seed"] + (mesh is not None)}))
    with pytest.raises(AssertionError, match="initial token_embedding/embeddings"):
        harness.assert_trains_like_one_device("gpt", "data=8")
