"""Planning a Mixture-of-Experts model: the experts' weights split over ``expert``, the
dispatch's all-to-alls against the compiled program's, and ``--mesh auto`` searching the
axis for MoE models only."""

import pytest

from kdist.parallel import combinations
from kdist.planning import choose_mesh, estimate, mesh_spec, parse_bytes, plan
from kdist.planning.estimate import cost_model_of
from kdist.planning.search import candidate_meshes

# gpt-nano-moe's width, fewer layers, and the SwiGLU experts the figures below were measured
# on (8 of 336, top-2: the preset before its GELU and shared experts)
NANO = {"vocabulary_size": 512, "num_layers": 2,
        "moe": {"num_experts": 8, "experts_per_token": 2, "expert_dim": 336, "routed_scale": 4.0}}
CAPACITY = {"num_experts": 8, "experts_per_token": 2, "expert_dim": 336,
            "capacity_factor": 1.25}


def test_expert_plan_matches_the_compiled_all_to_alls_and_memory():
    p = plan("gpt-nano-moe", mesh="expert=2,data=4", global_batch_size=16, sequence_length=64,
             device_memory="16GiB", model_overrides=NANO, suggest=False)
    # Two all-to-alls per MoE layer forward, two backward, of the (E, C, D) buffer with
    # C = n k (dropless): 4 x 2 layers x ring(2) x 8 x (128 x 2) x 256 x 4 bytes = 8 MiB.
    assert p.collectives["all-to-all"]["count"] == 8
    assert p.collectives["all-to-all"]["wire_bytes"] == pytest.approx(
        p.theoretical_collectives["all-to-all"], rel=1e-6)
    assert p.theoretical_collectives["all-to-all"] == 8 * 2**20
    # Per axis: the other weights' gradients are summed over data x expert, the experts'
    # (split over expert) over data only; XLA's scalars aside, within 5%.
    for axis in ("data", "expert"):
        assert p.axis_bytes["compiled"][axis] == pytest.approx(
            p.axis_bytes["theoretical"][axis], rel=0.05)
    # Memory: the experts' weights halved (Adam's state too), the buffers and per-expert
    # activations counted; within the 15% of the other plan tests (1.00 measured).
    e = estimate(cost_model_of("gpt-nano-moe", **NANO), p.mesh, 16, 64)
    assert e["parameters"] == pytest.approx(p.memory["parameters"], rel=1e-4)
    assert abs(e["total"] / p.total - 1) <= 0.15, (e["total"], p.total)
    assert "(4,858,368 parameters, 1,761,792 active)" in p.report().splitlines()[1]


def test_capacity_slots_and_fsdp_plan_like_the_compiled_program():
    overrides = {**NANO, "moe": CAPACITY}
    p = plan("gpt-nano-moe", mesh="expert=2,fsdp=4", global_batch_size=16, sequence_length=64,
             device_memory="16GiB", model_overrides=overrides, suggest=False)
    # C = ceil(1.25 x 128 x 2 / 8) = 40 slots: 4 x 2 x ring(2) x 8 x 40 x 256 x 4 bytes.
    assert p.collectives["all-to-all"]["wire_bytes"] == pytest.approx(
        p.theoretical_collectives["all-to-all"], rel=1e-6) == 1_310_720
    # The experts' weights split over expert x fsdp; one layer's gathered whole in the
    # region (experts.gathered_bytes). 0.90 of the compiled peak measured.
    e = estimate(cost_model_of("gpt-nano-moe", **overrides), p.mesh, 16, 64)
    assert e["parameters"] == pytest.approx(p.memory["parameters"], rel=1e-4)
    assert abs(e["total"] / p.total - 1) <= 0.15, (e["total"], p.total)


def test_auto_searches_expert_for_moe_models_only():
    dense = candidate_meshes(8, "gpt-nano", 16, sequence_length=64)
    assert all(m["expert"] == 1 for m in dense)
    moe = cost_model_of("gpt-nano-moe", **NANO)
    meshes = candidate_meshes(8, moe, 16, sequence_length=64)
    split = [m for m in meshes if m["expert"] > 1]
    assert {m["expert"] for m in split} == {2, 4, 8}  # divisors of its 8 experts
    # Combinations the table builds (with model or seq too:
    # tests/planning/test_plan_expert_combinations.py).
    for m in split:
        combinations.check({a for a, n in m.items() if n > 1}, mesh_spec(m))
    # Dropless, the fixed-capacity buffer moves E x the tokens: tensor parallelism is
    # cheaper here. With a capacity factor of 1.25 the all-to-alls move 1/5 of that, and
    # the experts split over every device fit with the least traffic.
    assert choose_mesh(moe, 8, parse_bytes("16GiB"), 16, 64)[0]["expert"] == 1
    capped = cost_model_of("gpt-nano-moe", **{**NANO, "moe": CAPACITY})
    mesh, rows, why = choose_mesh(capped, 8, parse_bytes("16GiB"), 16, 64)
    assert mesh_spec(mesh) == "expert=8" and "the experts' all-to-alls weigh double" in why
    assert not any(r["parallelism"].mesh["expert"] > 1
                   for r in choose_mesh("gpt-nano", 8, parse_bytes("16GiB"), 16, 64)[1])


def test_expert_memory_splits_only_the_experts_weights():
    moe = cost_model_of("gpt-nano-moe", **NANO)
    routed = moe.experts.parameters
    one, split = (estimate(moe, mesh, 16, 64) for mesh in ({"data": 8},
                                                          {"data": 4, "expert": 2}))
    assert one["parameters"] - split["parameters"] == pytest.approx(routed * 4 / 2)
    both = estimate(moe, {"fsdp": 4, "expert": 2}, 16, 64)
    assert both["parameters"] == pytest.approx(
        (moe.parameters - routed) * 4 / 4 + routed * 4 / 8)
    # Capacity slots (ceil(1.25 x 128 x 2 / 8) = 40 per expert) keep fewer rows than
    # dropless's n k = 256 per expert and source device.
    capped = estimate(cost_model_of("gpt-nano-moe", **{**NANO, "moe": CAPACITY}),
                      {"data": 4, "expert": 2}, 16, 64)
    assert capped["activations"] < 0.5 * split["activations"]
