"""`kdist plan`: the compiled train step's memory, FLOPs and collectives, before running."""

import jax
import pytest

from kdist.cli import main
from kdist.measure import measure_train_memory
from kdist.models import GPT_PRESETS, GPTCausalLM
from kdist.planning import choose_mesh, estimate, mesh_spec, parse_bytes, plan

NANO = {"vocabulary_size": 512, "num_layers": 2}  # gpt-nano's width, fewer layers


def test_fsdp_plan_shards_state_and_allocates_nothing():
    before = sum(a.nbytes for a in jax.live_arrays())
    p = plan("gpt-nano", mesh="fsdp=8", global_batch_size=16, sequence_length=64,
             device_memory="16GiB", model_overrides=NANO)
    # No weight or optimizer slot was ever allocated.
    assert sum(a.nbytes for a in jax.live_arrays()) - before < 2**20
    replicated = p.parameters * 4
    m = p.memory
    assert replicated / 8 <= m["parameters"] <= replicated / 8 + 64 * 1024  # + small tensors
    assert m["optimizer_state"] == pytest.approx(2 * m["parameters"], rel=0.01)
    assert sum(v for k, v in m.items() if k != "total") == pytest.approx(m["total"])
    # FSDP gathers the weights: the all-gathers move at least the (sharded) parameters.
    assert p.collectives["all-gather"]["bytes"] >= replicated * 0.9
    assert 1.0 < p.flops["xla"] / p.flops["formula"] < 1.2
    assert p.fits and "verdict: FITS" in p.report()


def test_too_little_memory_gets_a_verdict_and_an_estimated_suggestion():
    p = plan("gpt-nano", mesh="data=8", global_batch_size=16, sequence_length=64,
             device_memory="30MiB", model_overrides=NANO, verify=False)
    assert not p.fits and "verdict: DOES NOT FIT" in p.report()
    s = p.suggestion
    assert s["fits"] and s["total"] <= parse_bytes("30MiB") * 0.9 and not s["verified"]
    assert s["mesh"] == "fsdp=8"  # sharding the replicated state is the first thing to try
    assert "suggestion: --mesh fsdp=8" in p.report()


@pytest.mark.slow
def test_a_mesh_that_cannot_fit_gets_a_verdict_and_a_verified_suggestion(capsys):
    status = main(["plan", "--preset", "gpt-nano", "--mesh", "data=8", "--global-batch-size",
                   "16", "--sequence-length", "128", "--device-memory", "120MiB"])
    out = capsys.readouterr().out
    assert status == 1
    assert "verdict: DOES NOT FIT" in out
    suggestion = next(line for line in out.splitlines() if line.startswith("suggestion:"))
    assert "(compiled)" in suggestion and "still does not fit" not in suggestion
    assert "--mesh fsdp=8" in suggestion or "--grad-accum" in suggestion


def test_auto_mesh_prefers_least_communication_that_fits():
    config = GPT_PRESETS["gpt2-small"]
    roomy, rows, why = choose_mesh(config, 8, parse_bytes("80GiB"), 64, 1024)
    assert mesh_spec(roomy) == "data=8"  # gradients' all-reduce only
    assert "fits" in why and len(rows) >= 3
    # 4 GiB per device, one sequence each: replicated state (2 GB) plus activations (2.3 GB)
    # no longer fit; sharded state does.
    tight, rows, why = choose_mesh(config, 8, parse_bytes("4GiB"), 8, 1024)
    assert tight["data"] < 8
    assert not next(r for r in rows if r["mesh"] == "data=8")["fits"]
    assert estimate(config, tight, 8, 1024)["total"] <= parse_bytes("4GiB") * 0.9
    assert all(r["wire_bytes"] >= min(r2["wire_bytes"] for r2 in rows if r2["fits"])
               for r in rows if r["fits"])


def test_bad_input_is_refused_before_compiling():
    with pytest.raises(ValueError, match="needs 16 devices"):
        plan("gpt-nano", mesh="fsdp=16", global_batch_size=16)
    with pytest.raises(ValueError, match="micro-batch .* must divide"):
        plan("gpt-nano", mesh="fsdp=8", global_batch_size=12)
    with pytest.raises(ValueError, match="Unknown precision"):
        plan("gpt-nano", mesh="fsdp=8", precision="fp8")
    with pytest.raises(ValueError, match="Cannot read a memory size"):
        plan("gpt-nano", mesh="fsdp=8", device_memory="lots")


@pytest.mark.slow
def test_planned_memory_matches_a_real_run_within_15_percent():
    """gpt-nano, float32, batch 32 x 256, 1 device: planned peak vs the measured peak
    (device memory stats, or on CPU the peak RSS above the idle baseline; see
    kdist/measure.py). benchmarks/plan_accuracy.py runs three configurations.

    The default loss here is the logits path ("auto" keeps it for an 8192-entry
    vocabulary). With the fused loss forced on this shape, XLA's memory_analysis was 18%
    below the measured peak on XLA:CPU (1.68 GB planned, 2.07 GB measured): a known gap
    (benchmarks/README.md), not covered by this test."""
    p = plan("gpt-nano", mesh="data=1", devices=jax.devices()[:1], global_batch_size=32,
             sequence_length=256, device_memory="1TiB")
    run = measure_train_memory("gpt-nano", 32, 256, steps=2)
    assert run["compiled"] == 0  # the measured run loaded every program: no compiler's peak
    measured = run["peak"]
    assert abs(p.total / measured - 1) <= 0.15, (p.total, measured)


@pytest.mark.slow
def test_gpt2_xl_plans_here_with_an_eighth_of_the_state_per_device():
    # Its 48 blocks as one scanned stack: XLA compiles one block, not 48 (16 s against 534 s
    # on these 2 cores), and the state per device is the same question — every weight, the
    # stacked norm scales and biases too, split 8 ways.
    p = plan("gpt2-xl", mesh="fsdp=8", global_batch_size=64, sequence_length=1024,
             device_memory="80GiB", suggest=False, model_overrides={"scan_layers": True})
    assert p.parameters > 1.5e9
    replicated = p.parameters * 4 * 3  # float32 weights + Adam's two moments
    per_device = p.memory["parameters"] + p.memory["optimizer_state"]
    # Every weight is split 8 ways, the norm scales and biases too (ZeRO-3); only Adam's
    # scalar step counters are replicated.
    assert per_device <= replicated / 8 + 64
    assert p.collectives["all-gather"]["count"] > 0


def test_any_family_is_planned_through_its_cost_model(capsys):
    # A BERT preset: its cost model gives the formula, the minimum collectives, the search.
    status = main(["plan", "--preset", "bert-base", "--mesh", "auto", "--global-batch-size",
                   "8", "--sequence-length", "128", "--device-memory", "16GiB"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "plan: bert-base (110,104,890 parameters)" in out  # the MLM head included
    assert "mesh auto: data=4,model=2: fits" in out and "mesh data=4,model=2 over 8" in out
    assert "verdict: FITS" in out and "theoretical min" in out
    # A model function whose task has a cost model: mesh="auto" and the formula work too.
    p = plan(lambda: GPTCausalLM.from_preset("gpt-nano", **NANO), mesh="auto",
             global_batch_size=16, sequence_length=64, device_memory="16GiB", suggest=False)
    cost = GPTCausalLM.cost_model_for({**GPT_PRESETS["gpt-nano"], **NANO})
    assert p.mesh == choose_mesh(cost, 8, parse_bytes("16GiB"), 16, 64)[0]
    assert p.mesh_choice and p.mesh["model"] == 2  # the cost model states its dimensions
    assert 1.0 < p.flops["xla"] / p.flops["formula"] < 1.2
    assert p.theoretical_collectives["all-reduce"] > 0


def test_auto_compiles_its_choice_and_takes_the_next_when_the_estimate_was_wrong():
    """gpt2-xl: auto chose data=2,fsdp=2,seq=2 as fitting (63.97 GiB estimated) and the
    compiled plan then said 95.49 GiB, does not fit. Here, small: data=8 is estimated at
    54 MiB and compiles to 61 MiB; with 58 MiB usable the next choice must be taken."""
    memory = int(58 * 2**20 / 0.9)  # 58 MiB usable
    p = plan("gpt-nano", mesh="auto", global_batch_size=16, sequence_length=256,
             model_overrides=NANO, device_memory=memory, suggest=False)
    assert p.fits and mesh_spec(p.mesh) == "data=4,fsdp=2"
    assert "data=8 (estimated 54.11 MiB, compiled 60.90 MiB: does not fit)" in p.mesh_choice
    assert p.report().splitlines()[1].startswith("plan: gpt-nano")


def test_the_first_line_says_where_the_device_memory_came_from(capsys):
    p = plan("gpt-nano", mesh="fsdp=8", global_batch_size=16, sequence_length=64,
             model_overrides=NANO, suggest=False)
    first = p.report().splitlines()[0]
    assert first.startswith("device memory: ") and "shared by its 8 cpu devices" in first
    assert "pass --device-memory (e.g. 80GiB) to plan for an accelerator" in first
    p = plan("gpt-nano", mesh="fsdp=8", global_batch_size=16, sequence_length=64,
             model_overrides=NANO, suggest=False, device_memory="80GiB")
    assert p.report().splitlines()[0] == "device memory: 80.00 GiB per device (given)"


def test_a_model_axis_is_refused_with_sizes_that_can_form_the_mesh(capsys):
    """gpt2-small's 12 heads on model=8: the fix offered 3, 6 and 12, which 8 devices
    cannot form."""
    assert main(["plan", "--preset", "gpt2-small", "--mesh", "model=8",
                 "--sequence-length", "128"]) == 2
    err = capsys.readouterr().err
    assert "num_heads=12 does not divide by the 'model' mesh axis of size 8. Over 8 " \
           "devices the 'model' axis can be 1, 2, 4 for this model" in err


def test_a_plan_hands_back_the_distribution_it_planned():
    """plan(...).parallelism is the configuration planned (the chosen mesh and schedule):
    kdist.distribution(plan.parallelism) trains what was planned, no keyword re-typed."""
    import kdist

    p = plan("gpt-nano", mesh="auto", global_batch_size=64, sequence_length=128,
             pipeline_schedule="1f1b", pipeline_microbatches=4, device="tpu-v5e",
             num_devices=8, compile="none", suggest=False)
    assert p.parallelism.spec == mesh_spec(p.mesh)
    if p.parallelism.stages > 1:
        assert p.parallelism.settings["pipeline_schedule"] == "1f1b"
    dist = kdist.distribution(p.parallelism)
    assert dist.config == p.parallelism
