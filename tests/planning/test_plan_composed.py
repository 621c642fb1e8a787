"""Planning composed meshes: pipeline stages with ``seq`` inside, DiLoCo replica groups of
pipelined groups, bytes per mesh axis (compiled beside the theory), the axes that cross
the host boundary and how ``--mesh auto`` weighs them."""

import pytest

from kdist.parallel import combinations
from kdist.planning import choose_mesh, estimate, mesh_spec, parse_bytes, plan, traffic
from kdist.planning.estimate import collective_terms
from kdist.planning.search import candidate_meshes, pipeline_meshes

# 8 layers whose state is mostly MLP weights; 5 heads and an odd width: no 'model' axis,
# no 'fsdp' axis — only stages split the weights, only 'seq' and 'data' the tokens.
DEEP_NARROW = {"vocabulary_size": 512, "num_layers": 8, "num_heads": 5, "hidden_dim": 125,
               "intermediate_dim": 20000, "max_sequence_length": 1024}


def test_a_diloco_group_of_pipelined_context_parallel_stages_plans_per_axis():
    p = plan("gpt-nano", mesh="replica=2,stage=2,seq=2", sync_every=4, global_batch_size=8,
             sequence_length=64, devices_per_host=4, device_memory="16GiB", suggest=False,
             model_overrides={"vocabulary_size": 512, "num_layers": 2})
    compiled, theory = p.axis_bytes["compiled"], p.axis_bytes["theoretical"]
    assert set(compiled) == set(theory) == {"replica", "stage", "seq"}
    # The sync step's all-reduce of the outer gradient over replica, the keys and values
    # over seq: byte for byte (a few bytes of XLA's scalars); the stage sends within 0.3%.
    assert compiled["replica"] == pytest.approx(theory["replica"], rel=1e-5)
    assert compiled["seq"] == pytest.approx(theory["seq"], rel=1e-5)
    assert compiled["stage"] == pytest.approx(theory["stage"], rel=3e-3)
    assert theory["replica"] == pytest.approx(p.memory["parameters"], rel=1e-5)  # 2 ring(2)
    # Two hosts of 4: only the groups' sync crosses (replica is the slowest-varying axis).
    assert p.crosses_hosts == ["replica"] and p.devices_per_host == 4
    # Each group's inner Adam (2x), its weights' anchor and outer momentum (2x more).
    assert p.memory["optimizer_state"] == pytest.approx(4 * p.memory["parameters"], rel=1e-4)
    text = p.report()
    assert "crosses hosts" in text and "every 4 steps" in text


def test_stage_seq_fsdp_bytes_per_axis_and_the_axes_across_hosts():
    mesh = {"stage": 2, "seq": 2, "fsdp": 2}
    per_axis = traffic.by_axis(collective_terms("gpt-nano", mesh, 8, 64, 4), mesh)
    assert set(per_axis) == {"stage", "fsdp", "seq"}
    # Activations of each stage split over seq: less than the pipeline alone keeps.
    alone = estimate("gpt-nano", {"stage": 2, "fsdp": 2}, 8, 256)
    split = estimate("gpt-nano", mesh, 8, 256)
    assert split["parameters"] == alone["parameters"]
    assert split["activations"] < 0.6 * alone["activations"]
    # Hosts of 2 devices: seq (fastest) stays inside, fsdp and stage cross.
    assert traffic.crossing_axes(mesh, 2) == ("stage", "fsdp")
    assert traffic.crossing_axes(mesh, 8) == ()


def test_which_axes_cross_hosts_follows_the_mesh_order():
    every = {"replica": 2, "data": 2, "stage": 2, "fsdp": 2, "seq": 2, "model": 2}
    assert traffic.crossing_axes(every, 8) == ("replica", "data", "stage")
    assert traffic.crossing_axes(every, 4) == ("replica", "data", "stage", "fsdp")
    assert traffic.crossing_axes(every, None) == ()
    # An axis that starts inside a host: only its hierarchical share crosses.
    assert traffic.crossing_fractions({"data": 16}, 8)["data"] == pytest.approx(
        (1 / 2) / 8 / (15 / 16))
    # The hierarchical split carries the flat ring's bytes in all.
    term = traffic.Traffic("all-reduce", ("data", "fsdp", "seq"), 1000.0)
    assert sum(traffic.by_axis([term], {"data": 2, "fsdp": 4, "seq": 2}).values()) == \
        pytest.approx(1000.0)
    with pytest.raises(ValueError, match="devices_per_host must be a positive integer"):
        traffic.crossing_fractions(every, 0.5)


def test_the_slow_link_between_hosts_changes_the_choice():
    budget = parse_bytes("8GiB")
    one_host, _, _ = choose_mesh("gpt2-small", 8, budget, 8, 2048)
    hosts, rows, why = choose_mesh("gpt2-small", 8, budget, 8, 2048, devices_per_host=2)
    # On one host fsdp's gathers are cheapest; over hosts of 2 they would cross the slow
    # link, so auto keeps fsdp out and splits the tokens inside each host instead.
    assert mesh_spec(one_host) == "data=2,fsdp=4"
    assert mesh_spec(hosts) == "data=4,seq=2"
    assert "bytes between hosts 9x" in why and "across hosts: data (100% of its bytes)" in why
    sharded = next(r for r in rows if r["mesh"] == "data=2,fsdp=4")
    # fsdp=4 spans 2 hosts of 2: a third of its ring's bytes cross (ring(2) / 2 / ring(4)).
    assert sharded["crosses_hosts"] == {"data": 1.0, "fsdp": pytest.approx(1 / 3, abs=1e-4)}
    # The weighting alone makes the difference: with an equally fast link, one host's pick.
    same, _, _ = choose_mesh("gpt2-small", 8, budget, 8, 2048, devices_per_host=2,
                             host_link_slowdown=1.0)
    assert mesh_spec(same) == "data=2,fsdp=4"


def _tight_budget():
    """Between the best mesh without stages and stage=2,seq=4 (one row per microbatch:
    inside a stage only seq can split)."""
    plain = min(estimate(DEEP_NARROW, m, 8, 1024)["total"]
                for m in candidate_meshes(8, DEEP_NARROW, 8, sequence_length=1024))
    piped = estimate(DEEP_NARROW, {"stage": 2, "seq": 4}, 8, 1024,
                     pipeline_microbatches=8)["total"]
    assert piped < plain
    return (plain + piped) / 2 / 0.9


def test_auto_pipelines_with_seq_inside_the_stages_when_nothing_else_fits():
    assert "stage=2,seq=4" in {mesh_spec(m) for m in pipeline_meshes(
        8, DEEP_NARROW, 8, microbatches=8, sequence_length=1024)}
    mesh, rows, why = choose_mesh(DEEP_NARROW, 8, _tight_budget(), 8, 1024,
                                  pipeline_microbatches=8)
    assert mesh_spec(mesh) == "stage=2,seq=4", why
    assert "no mesh without a pipeline fits" in why
    # The meshes without stages were searched too (the schedule's flags do not apply to
    # them, they used to be refused and silently dropped).
    assert {"data=8", "seq=8"} <= {r["mesh"] for r in rows if not r["bubble"]}


def test_auto_never_returns_a_combination_the_table_refuses(monkeypatch):
    table = dict(combinations._BY_PAIR)
    table[frozenset(("stage", "seq"))] = combinations.refused(
        "stage", "seq", "does not combine with {b} (a test's table).")
    monkeypatch.setattr(combinations, "_BY_PAIR", table)
    mesh, rows, _ = choose_mesh(DEEP_NARROW, 8, _tight_budget(), 8, 1024,
                                pipeline_microbatches=8)
    assert not (mesh["stage"] > 1 and mesh["seq"] > 1)
    assert not any("stage" in r["mesh"] and "seq" in r["mesh"] for r in rows)
