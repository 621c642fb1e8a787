"""pipeline_schedule='1f1b' / 'interleaved_1f1b' / 'zero_bubble' in the training step (the
loss inside the schedule: kdist.parallel.pipeline.stack.scheduled). Parity with one device and
GPipe is in the combination table (tests/parallel/combinations.py); here: what is refused
and where, evaluation, generation and a resumed checkpoint of a model trained so, the
plan's memory and timeline, and pipeline_schedule="auto"."""

import keras
import numpy as np
import pytest

import kdist
from kdist.models import BertBackbone, BertClassifier, BertMaskedLM, GPTBackbone, GPTCausalLM
from tests.bert_helpers import TINY_BERT
from tests.helpers import TINY_GPT, parity_optimizer

DEEP = dict(TINY_GPT, num_layers=8)


@pytest.mark.parametrize("mesh, options, message", [
    ("data=8", dict(pipeline_schedule="1f1b"),
     "pipeline_schedule='1f1b' orders a pipeline's microbatches; mesh 'data=8' has no 'stage'"),
    ("stage=4,data=2", dict(pipeline_schedule="zb-h1"),
     "pipeline_schedule must be one of gpipe, 1f1b, interleaved_1f1b, zero_bubble; got 'zb-h1'"),
    ("stage=4,data=2", dict(pipeline_schedule="zero_bubble", pipeline_repeats=2),
     "pipeline_schedule='zero_bubble' runs one model chunk per stage; got 2"),
    # (with fsdp, model, seq, replica groups or gradient_reduction: combination table rows)
    ("stage=2,seq=2,data=2", dict(pipeline_schedule="zero_bubble", context_parallel="ring"),
     "pipeline_schedule='zero_bubble' runs ticks that mix .* Use pipeline_schedule='1f1b' or "
     "'interleaved_1f1b' with ring attention"),
    ("stage=4,data=2", dict(pipeline_schedule="1f1b", pipeline_repeats=2),
     "runs one model chunk per stage; got 2 \\(pipeline_repeats\\)"),
    ("stage=4,data=2", dict(pipeline_schedule="interleaved_1f1b"),
     "several model chunks per stage; got pipeline_repeats=1"),
    ("stage=4,data=2", dict(pipeline_schedule="interleaved_1f1b", pipeline_repeats=2,
                            pipeline_microbatches=6),
     "pipeline_microbatches=6 is not a multiple of 4"),
])
def test_a_schedule_it_cannot_run_is_refused_by_the_distribution(mesh, options, message):
    with pytest.raises(ValueError, match=message):
        kdist.distribution(mesh, **options)


def _gpt(mesh="stage=4,data=2", config=DEEP, **options):
    keras.distribution.set_distribution(kdist.distribution(mesh, **options))
    keras.utils.set_random_seed(0)
    return GPTCausalLM(GPTBackbone(**config))


def test_a_model_that_cannot_put_its_loss_in_the_schedule_is_refused_at_compile():
    keras.distribution.set_distribution(
        kdist.distribution("stage=2,data=4", pipeline_schedule="1f1b"))
    classifier = BertClassifier(BertBackbone(**dict(TINY_BERT, scan_layers=True)),
                                num_classes=2)
    with pytest.raises(ValueError, match="does not declare the 'scheduled_pipeline' step "
                                         "feature\\). Use pipeline_schedule='gpipe'"):
        classifier.compile(optimizer="adam")


def test_bert_under_1f1b_refuses_another_loss_and_evaluates_with_gpipes_forward_pass():
    """The masked LM's loss (weighted by the mask weights) inside the schedule; parity with
    one device is a row of the combination table. A loss of the user's is refused at
    compile; evaluation runs the stack unpipelined, on the same weights."""
    from tests.bert_helpers import mlm_batches

    keras.distribution.set_distribution(
        kdist.distribution("stage=2,data=4", pipeline_schedule="1f1b"))
    keras.utils.set_random_seed(0)
    bert = BertMaskedLM(BertBackbone(**dict(TINY_BERT, scan_layers=True)))
    with pytest.raises(ValueError, match="asks for another loss. Leave the loss out"):
        bert.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy())
    bert.compile(optimizer=parity_optimizer())
    x, y, w = mlm_batches(1)[0]
    evaluated = bert.evaluate(x, y, sample_weight=w, verbose=0)
    trained = float(bert.train_on_batch(x, y, sample_weight=w))
    np.testing.assert_allclose(trained, evaluated, rtol=2e-6)


def test_targets_not_per_token_are_refused_under_a_split_sequence():
    """Under seq every device's loss sees its share of the tokens: BERT's masked positions
    (not one target per token) cannot be split so; refused while tracing, naming the fix."""
    from tests.bert_helpers import mlm_batches

    keras.distribution.set_distribution(kdist.distribution(
        "stage=2,seq=2,data=2", pipeline_schedule="1f1b", context_parallel="all_gather"))
    keras.utils.set_random_seed(0)
    bert = BertMaskedLM(BertBackbone(**dict(TINY_BERT, scan_layers=True)))
    bert.compile(optimizer=parity_optimizer())
    x, y, w = mlm_batches(1)[0]
    with pytest.raises(ValueError, match="every target must hold one value per token .* Use "
                                         "pipeline_schedule='gpipe' on this mesh"):
        bert.train_on_batch(x, y, sample_weight=w)


def test_another_loss_is_refused_at_compile():
    lm = _gpt(pipeline_schedule="1f1b")
    with pytest.raises(ValueError, match="computes the default loss .* asks for another "
                                         "loss"):
        lm.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy())


@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_metrics_under_1f1b_equal_gpipes(model):
    """The task's parts run in the schedule, its call() still returns logits: accuracy under
    1F1B (from GPipe's forward pass of the same weights) equals GPipe's (from its training
    forward pass), step after step, and so do the losses (float32, no dropout; GPipe's
    parity with one device is the combination table's)."""
    from tests.bert_helpers import mlm_batches

    results = {}
    for schedule in ("gpipe", "1f1b"):
        if model == "gpt":
            lm = _gpt("stage=2,data=4", pipeline_schedule=schedule)
            lm.compile(optimizer=parity_optimizer(), metrics=["accuracy"])
            ids = np.random.default_rng(0).integers(0, 256, (2, 8, 17)).astype("int32")
            batches = [(b[:, :-1], b[:, 1:], None) for b in ids]
        else:
            keras.distribution.set_distribution(
                kdist.distribution("stage=2,data=4", pipeline_schedule=schedule))
            keras.utils.set_random_seed(0)
            lm = BertMaskedLM(BertBackbone(**dict(TINY_BERT, scan_layers=True)))
            lm.compile(optimizer=parity_optimizer(), weighted_metrics=[
                keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
            batches = mlm_batches(2)
        results[schedule] = [lm.train_on_batch(x, y, sample_weight=w, return_dict=True)
                             for x, y, w in batches]
    for gpipe, scheduled in zip(results["gpipe"], results["1f1b"]):
        assert scheduled["accuracy"] == pytest.approx(gpipe["accuracy"], abs=1e-7)
        np.testing.assert_allclose(scheduled["loss"], gpipe["loss"], rtol=2e-6)


def test_a_sample_weight_is_refused_by_name():
    lm = _gpt(pipeline_schedule="1f1b")
    lm.compile(optimizer="adam")
    x = np.random.default_rng(0).integers(0, 256, (8, 17)).astype("int32")
    with pytest.raises(ValueError, match="unweighted default loss .* given a sample_weight"):
        lm.fit(x[:, :-1], x[:, 1:], sample_weight=np.ones((8, 16), "float32"), verbose=0)


def test_evaluation_and_generation_of_a_model_trained_with_1f1b():
    """Evaluation runs GPipe's forward pass: the loss of the same weights as the first
    training step's, which 1F1B computed; the model then generates."""
    lm = _gpt(pipeline_schedule="1f1b", pipeline_microbatches=4)
    lm.compile(optimizer=parity_optimizer())
    x = np.random.default_rng(1).integers(0, 256, (8, 17)).astype("int32")
    evaluated = lm.evaluate(x[:, :-1], x[:, 1:], verbose=0)
    trained = float(lm.train_on_batch(x[:, :-1], x[:, 1:]))
    np.testing.assert_allclose(trained, evaluated, rtol=2e-6)
    later = [float(lm.train_on_batch(x[:, :-1], x[:, 1:])) for _ in range(3)]
    assert later[-1] < trained  # (parity_optimizer's first step has no learning rate)
    assert lm.generate(x[:2, :4], max_length=8, sampler="greedy").shape == (2, 8)


def _plan(schedule, microbatches, repeats=1, mesh="stage=2,data=4"):
    return kdist.planning.plan("gpt-nano", mesh=mesh, global_batch_size=64, sequence_length=64,
                           pipeline_schedule=schedule, pipeline_microbatches=microbatches,
                           pipeline_repeats=repeats, suggest=False,
                           model_overrides={"vocabulary_size": 512})


def test_the_plan_compiles_the_schedule_and_its_activations_do_not_grow_with_m():
    """From the compiled programs (kdist plan): 1F1B's and interleaved's activations at
    M = 16 are at most half GPipe's, and do not grow from M = 8 to M = 16. The analytic
    estimate (what --mesh auto ranks by) follows the schedule, and the bytes sent between
    stages are the table's: one activation each way per tick."""
    activations, reports = {}, {}
    # GPipe at M = 16 only: it is the yardstick of the others at M = 16, and the claim of
    # not growing from M = 8 to 16 is theirs (its own activations do grow); each compiled
    # plan costs ~7 CPU-s.
    for schedule, repeats in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2),
                              ("zero_bubble", 1)):
        for m in (16,) if schedule == "gpipe" else (8, 16):
            result = _plan(schedule, m, repeats)
            reports[schedule, m] = result.report()
            activations[schedule, m] = result.memory["activations_and_temporaries"]
            assert result.pipeline["schedule"] == schedule
            analytic = kdist.planning.estimate(
                {**kdist.planning.preset_backbone_config("gpt-nano"), "vocabulary_size": 512},
                result.mesh, 64, 64, pipeline_microbatches=m, pipeline_repeats=repeats,
                pipeline_schedule=schedule)
            assert 0.3 < analytic["total"] / result.memory["total"] < 3
            sent = result.pipeline["bytes_to_next_stage"]
            assert result.theoretical_collectives["collective-permute"] == sent
            assert result.collectives["collective-permute"]["bytes"] == pytest.approx(sent)
    print({k: f"{v / 2**20:.1f} MiB" for k, v in activations.items()})
    for schedule in ("1f1b", "interleaved_1f1b", "zero_bubble"):
        assert activations[schedule, 16] <= 0.5 * activations["gpipe", 16]
        assert activations[schedule, 16] <= 1.15 * activations[schedule, 8]
    report = reports["1f1b", 8]
    assert "pipeline: 1f1b, 2 stages" in report
    # (the last stage has no forward of its own: its backward runs it)
    assert "microbatch chunks in flight per stage (their inputs kept): [2, 0]" in report
    assert "17 ticks, each of forwards only or backwards only; step ~ 35.0 forwards of a " \
        "stage" in report  # GPipe's (M + S - 1) (F + 3 F) less one F: 9 x 4 - 1
    assert "stage 0 | F0 .  F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7" in report
    report = reports["zero_bubble", 8]
    assert "24 ticks, each of one forward, input gradient or weight gradient per stage, " \
        "kinds mixed; step ~ 52.0 forwards" in report
    assert "stage 1 | .  I0 I1 W0 W1 I2 W2 .  I3 W3" in report


@pytest.mark.parametrize("attention", ["all_gather", "ring"])
def test_the_plan_of_a_schedule_under_seq_follows_the_compiled_program(attention):
    """Under seq every stage holds its share of the tokens (with ring attention every stage
    runs each tick's kind of task): the analytic estimate --mesh auto ranks by stays within
    0.3-3x of the compiled program's total, as it does without seq."""
    mesh = "stage=2,seq=2,data=2"
    result = kdist.planning.plan("gpt-nano", mesh=mesh, global_batch_size=64,
                                 sequence_length=64, pipeline_schedule="1f1b",
                                 pipeline_microbatches=8, context_parallel=attention,
                                 suggest=False, model_overrides={"vocabulary_size": 512})
    analytic = kdist.planning.estimate(
        {**kdist.planning.preset_backbone_config("gpt-nano"), "vocabulary_size": 512},
        result.mesh, 64, 64, pipeline_microbatches=8, pipeline_schedule="1f1b",
        context_parallel=attention)
    assert result.pipeline["schedule"] == "1f1b"
    assert 0.3 < analytic["total"] / result.memory["total"] < 3, (analytic["total"],
                                                                  result.memory["total"])


def test_under_fsdp_each_stage_gathers_its_weights_once_per_step():
    """On stage=2,fsdp=4 the interpreter all-gathers each stage's weights over fsdp before
    the schedule and reduce-scatters their gradient after it: the compiled program's fsdp
    bytes are the plan's theory (one gather, one reduce-scatter per step; 1.065x measured,
    where a gather at each of the 22 ticks would be ~20x), and its permutes the table's."""
    result = _plan("1f1b", 8, mesh="stage=2,fsdp=4")
    compiled, theory = (result.axis_bytes[k]["fsdp"] for k in ("compiled", "theoretical"))
    assert 1.0 <= compiled / theory < 1.1, (compiled, theory)
    sent = result.pipeline["bytes_to_next_stage"]
    assert result.collectives["collective-permute"]["bytes"] == pytest.approx(sent)


def test_under_model_tensor_parallelism_runs_inside_each_stage():
    """On stage=2,fsdp=2,model=2 (parity: rows of the combination table) ``model`` stays
    with XLA's partitioner inside the interpreter's region: the compiled 1F1B step
    all-reduces the stages' activations over ``model`` inside the schedule's loop (once per
    tick and layer, every branch counted), as GPipe's stages do inside theirs."""
    from kdist import hlo
    from kdist.parallel.pipeline import schedules
    from kdist.planning.compile import compile_train_step

    mesh = "stage=2,fsdp=2,model=2"
    dist = kdist.distribution(mesh, pipeline_schedule="1f1b", pipeline_microbatches=4)
    lm = _gpt(mesh, dict(DEEP, scan_layers=True), pipeline_schedule="1f1b",
              pipeline_microbatches=4)
    lm.compile(optimizer="adam")
    x = np.zeros((16, 16), "int32")
    compiled, _ = compile_train_step(lm, x, x, dist)
    found = hlo.parse_collectives(compiled.as_text(), 8)
    ticks = schedules.build("1f1b", 2, 4).ticks
    per_tick = [c.executions // ticks for c in found if c.kind == "all-reduce"
                and c.axes(dist.mesh_shape) == {"model"} and c.executions % ticks == 0]
    assert per_tick and max(per_tick) == DEEP["num_layers"] // 2, per_tick  # 4 layers a stage


def test_auto_keeps_gpipe_when_it_fits_and_turns_to_1f1b_when_it_does_not():
    """pipeline_schedule='auto' (the recipes' and kdist plan's default): GPipe when its
    estimate fits (it recomputes nothing and sends half the activations), else 1F1B (or
    interleaved, with repeats), and only where the distribution and the task allow it."""
    from kdist.planning import (
        choose_mesh,
        choose_schedule,
        estimate,
        mesh_spec,
        preset_backbone_config,
    )

    shape = dict(global_batch_size=64, sequence_length=256, pipeline_microbatches=16)
    mesh = {"stage": 4, "data": 2}
    gpipe = estimate("gpt-nano", mesh, 64, 256, pipeline_microbatches=16)["total"]
    one = estimate("gpt-nano", mesh, 64, 256, pipeline_microbatches=16,
                   pipeline_schedule="1f1b")["total"]
    assert one < 0.5 * gpipe
    roomy, tight = 2 * gpipe / 0.9, 2 * one / 0.9  # device memory (90% usable)
    assert choose_schedule("gpt-nano", mesh, roomy, **shape)[0] == "gpipe"
    schedule, why = choose_schedule("gpt-nano", mesh, tight, **shape)
    assert schedule == "1f1b" and why.startswith("1f1b: gpipe does not fit and 1f1b does")
    assert choose_schedule("gpt-nano", {"stage": 2, "data": 4}, tight, 64, 256,
                           pipeline_microbatches=16, pipeline_repeats=2)[0] == "interleaved_1f1b"
    # Under seq: 1F1B with either attention; GPipe where the task's targets are not per
    # token (BERT's masked positions).
    assert choose_schedule("gpt-nano", {"stage": 4, "seq": 2}, tight, **shape)[0] == "1f1b"
    assert choose_schedule("gpt-nano", {"stage": 4, "seq": 2}, tight, **shape,
                           context_parallel="ring")[0] == "1f1b"
    assert choose_schedule("bert-tiny", {"stage": 4, "seq": 2}, 1, 64, 128,
                           pipeline_microbatches=16)[0] == "gpipe"
    classifier = BertClassifier.cost_model_for(preset_backbone_config("bert-tiny"),
                                               num_classes=2)
    assert choose_schedule(classifier, mesh, 1, 64, 128, pipeline_microbatches=16) == (
        "gpipe", "the 1F1B schedules need the loss inside the schedule, which "
                 "BertCostModel's task does not compute there yet")
    assert choose_schedule("bert-tiny", mesh, 1, 64, 128, pipeline_microbatches=16)[0] == "1f1b"
    # --mesh auto ranks each pipeline by the schedule auto gives it: with 150 MiB usable
    # no mesh fits under GPipe (the best unpipelined one needs 338 MiB, GPipe's pipelines
    # 347 MiB and more) and the 1F1B pipelines do (67-100 MiB on stage x data/fsdp).
    budget = 150 * 2**20 / 0.9
    _, table, why = choose_mesh("gpt-nano", 8, budget, **shape, pipeline_schedule="gpipe")
    assert why.startswith("no mesh fits") and not any(r["fits"] for r in table)
    chosen, table, why = choose_mesh("gpt-nano", 8, budget, **shape, pipeline_schedule="auto")
    assert chosen["stage"] > 1 and why.endswith("with pipeline_schedule '1f1b'"), why
    assert {r["schedule"] for r in table if r["fits"]} == {"1f1b"}
    assert choose_schedule("gpt-nano", chosen, budget, **shape)[0] == "1f1b"
    assert mesh_spec(chosen) in {r["mesh"] for r in table}


def test_a_checkpoint_saved_under_1f1b_resumes_bit_exactly(tmp_path):
    """On stage=2,fsdp=4 under 1F1B: 4 steps straight, against 2 steps, a checkpoint, a
    new process-like start (a fresh model) that restores it and trains 2 more: the same
    losses and weights, bit for bit (the schedule changes no weight's layout)."""
    from kdist.checkpointing import Checkpoint, state_variables
    from kdist.data.lm import LMBatches

    def model():
        keras.utils.clear_session()
        keras.distribution.set_distribution(kdist.distribution(
            "stage=2,fsdp=4", pipeline_schedule="1f1b", pipeline_microbatches=4))
        keras.utils.set_random_seed(0)
        lm = GPTCausalLM(GPTBackbone(**DEEP))
        lm.compile(optimizer=parity_optimizer())
        return lm

    def data():
        return LMBatches(np.arange(5000) % 256, sequence_length=16, global_batch_size=16,
                         seed=3)

    def state(lm):
        return {k: np.asarray(v.value) for k, v in state_variables(lm).items()}

    def losses(history):
        return history.history["loss"]

    straight, batches = model(), data()
    want = losses(straight.fit(batches, epochs=2, steps_per_epoch=2, verbose=0))
    final = state(straight)

    first, batches = model(), data()
    first.fit(batches, epochs=1, steps_per_epoch=2, verbose=0, callbacks=[
        Checkpoint(tmp_path / "ckpt", save_every_steps=2, data=batches, verbose=False)])
    resumed, batches = model(), data()
    assert Checkpoint(tmp_path / "ckpt", data=batches, verbose=False).restore(resumed) == 2
    got = losses(resumed.fit(batches, epochs=1, steps_per_epoch=2, verbose=0))
    assert got[-1] == want[-1]  # the mean of steps 3 and 4
    for key, value in state(resumed).items():
        np.testing.assert_array_equal(value, final[key], err_msg=key)
