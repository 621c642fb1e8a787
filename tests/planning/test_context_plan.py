"""`kdist plan`, `--mesh auto` and the recipe know the `seq` axis."""

import sys

import pytest

from kdist.parallel.context import SequenceLayout
from kdist.parallel.context.cost import ring_bytes
from kdist.planning import (
    candidate_meshes,
    choose_mesh,
    estimate,
    mesh_spec,
    plan,
    theoretical_collective_bytes,
)
from tests.helpers import RECIPES

sys.path.insert(0, str(RECIPES))
import gpt_pretrain  # noqa: E402

NANO = {"num_layers": 1, "vocabulary_size": 512, "max_sequence_length": 1024}


def test_theoretical_bytes_of_the_ring_and_the_all_gather():
    layout = SequenceLayout(4096, 8, balanced=True)
    ring = theoretical_collective_bytes("gpt-nano", {"seq": 8}, 2, 4096,
                                        context_parallel="ring")
    # gpt-nano: 4 layers of 4 key/value heads of 64; 2 sequences on every device.
    assert ring["collective-permute"] == 4 * ring_bytes(layout, 2, 4, 64, 4)["total"]
    gathered = theoretical_collective_bytes("gpt-nano", {"seq": 8}, 2, 4096)
    one_layer = 2 * 4096 * 4 * 64 * 4  # a layer's keys (or values) of both sequences
    assert gathered["all-gather"] == gathered["reduce-scatter"] == 4 * 2 * 7 / 8 * one_layer
    data = theoretical_collective_bytes("gpt-nano", {"data": 8}, 16, 4096)
    assert ring["all-reduce"] == data["all-reduce"]  # weights replicated over seq: summed


def test_activations_per_device_fall_with_seq():
    one = estimate("gpt-nano", {"seq": 1}, 1, 8192)
    for variant in ("ring", "all_gather"):
        split = estimate("gpt-nano", {"seq": 8}, 1, 8192, context_parallel=variant)
        assert split["parameters"] == one["parameters"]  # replicated over seq
        assert split["activations"] < one["activations"] / 8  # and no T x T scores
    ring = estimate("gpt-nano", {"seq": 8}, 1, 8192, context_parallel="ring")
    gathered = estimate("gpt-nano", {"seq": 8}, 1, 8192)
    assert gathered["activations"] > ring["activations"]  # every layer's keys and values


def test_auto_mesh_splits_long_sequences_of_a_small_batch():
    assert {mesh_spec(m) for m in candidate_meshes(8, "gpt-nano", 1, sequence_length=64)} == {
        "seq=8", "seq=4,model=2", "seq=2,model=4"}
    assert all(m["seq"] == 1 for m in candidate_meshes(8, "gpt-nano", 16))  # no length: none
    assert 1 not in {m["seq"] for m in candidate_meshes(8, "gpt-nano", 1, sequence_length=8)}
    mesh, _, why = choose_mesh("gpt-nano", 8, 2**30, 1, 16384, context_parallel="ring")
    assert mesh["seq"] > 1 and "fits" in why
    mesh, _, _ = choose_mesh("gpt-nano", 8, 2**34, 16, 256)
    assert mesh_spec(mesh) == "data=8"  # short sequences, a batch to split: no seq


def test_plan_counts_the_ring_against_its_theoretical_bytes():
    p = plan("gpt-nano", mesh="seq=8", global_batch_size=1, sequence_length=1024,
             context_parallel="ring", device_memory="1GiB", model_overrides=NANO,
             suggest=False)
    permutes = p.collectives["collective-permute"]
    assert permutes["wire_bytes"] == p.theoretical_collectives["collective-permute"]
    assert permutes["count"] == 44  # 1 layer: 2 x 7 forward, 4 x 7 + 2 backward
    assert "collective-permute" in p.report() and p.fits
    with pytest.raises(ValueError, match=r"does not divide by 16.*1008 or 1024"):
        plan("gpt-nano", mesh="seq=8", global_batch_size=1, sequence_length=1020,
             model_overrides=NANO)


def test_recipe_checks_the_length_against_the_mesh(tmp_path):
    out = ["--output-dir", str(tmp_path)]
    with pytest.raises(ValueError, match=r"--sequence-length 100 on --mesh seq=8: .*divide by "
                                         r"16.*96 or 112"):
        gpt_pretrain.main(["--mesh", "seq=8", "--sequence-length", "100"] + out)
    with pytest.raises(ValueError, match=r"exceeds the 256 positions of --preset gpt-nano\. "
                                         r"Pass --sequence-length 256 or less\. Or give the "
                                         r"model that many positions: --max-sequence-length "
                                         r"4096"):
        gpt_pretrain.main(["--mesh", "seq=8", "--sequence-length", "4096"] + out)


@pytest.mark.slow
def test_recipe_trains_a_long_sequence_over_seq(tmp_path, capsys):
    summary = gpt_pretrain.main([
        "--mesh", "seq=8", "--context-parallel", "ring", "--global-batch-size", "1",
        "--sequence-length", "1024", "--max-sequence-length", "1024", "--steps", "2",
        "--eval-every", "2", "--eval-steps", "1", "--warmup-steps", "1",
        "--vocabulary-size", "1024", "--learning-rate", "3e-3", "--sample-length", "4",
        "--output-dir", str(tmp_path)])
    assert summary["mesh"] == "seq=8" and summary["tokens"] == 2 * 1024
    assert summary["validation_loss_after"] < summary["validation_loss_before"]
    assert "mesh seq=8 over 8 cpu devices" in capsys.readouterr().out
