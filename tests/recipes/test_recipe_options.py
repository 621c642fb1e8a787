"""The flags every recipe shares (recipes/recipe_options.py): one spelling in all four, the
same ``--remat`` as ``kdist plan``, and defaults that adapt to the flags they depend on —
checked against every legal value of those flags — while a value the user typed is refused
when it cannot work."""

import argparse
import sys

import jax
import keras
import pytest

import kdist
from kdist import cli
from tests.helpers import RECIPES

sys.path.insert(0, str(RECIPES))
import bert_finetune  # noqa: E402
import bert_pretrain  # noqa: E402
import gpt_finetune  # noqa: E402
import gpt_pretrain  # noqa: E402
import recipe_options  # noqa: E402
import recipe_run  # noqa: E402

RECIPE_MODULES = {"gpt_pretrain": gpt_pretrain, "bert_pretrain": bert_pretrain,
                  "bert_finetune": bert_finetune, "gpt_finetune": gpt_finetune}
NEEDS = {"gpt_finetune": ["--init-from", "."]}  # its one required flag
SHARED = ["--mesh", "--host-devices", "--gradient-reduction", "--error-feedback",
          "--sync-every", "--outer-learning-rate", "--outer-momentum", "--context-parallel",
          "--no-load-balance", "--pipeline-microbatches", "--pipeline-repeats", "--steps",
          "--global-batch-size", "--grad-accum", "--learning-rate", "--warmup-steps",
          "--weight-decay", "--eval-every", "--precision", "--remat", "--seed", "--output-dir",
          "--log-every", "--peak-tflops", "--profile-steps", "--checkpoint-dir",
          "--checkpoint-every", "--resume", "--attention-implementation"]
# Every --steps a user may type that the defaults depend on: tiny, prime, round, odd.
STEPS = [1, 2, 7, 9, 10, 20, 29, 50, 70, 97, 100, 150, 199, 200, 300, 1000, 1234]


def parse(name, argv):
    return RECIPE_MODULES[name].parse_args(NEEDS.get(name, []) + argv)


def flags(name) -> set[str]:
    parser = RECIPE_MODULES[name].build_parser()
    return {s for action in parser._actions for s in action.option_strings}


def test_every_recipe_has_the_same_mesh_schedule_run_and_checkpoint_flags():
    for name in RECIPE_MODULES:
        missing = [f for f in SHARED if f not in flags(name)]
        assert not missing, f"{name} lacks {missing}"


@pytest.mark.parametrize("name", RECIPE_MODULES)
def test_help_shows_every_default(name):
    """`--help` gave no default for --weight-decay, --seed or --output-dir: argparse shows
    one only beside a flag's help text."""
    parser = RECIPE_MODULES[name].build_parser()
    text = " ".join(parser.format_help().split())  # one line: defaults wrap
    for action in parser._actions:
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            shown = f"{action.help} (default: {action.default})" if action.help else None
            assert shown and " ".join(shown.split()) in text, action.option_strings


@pytest.mark.parametrize("name", RECIPE_MODULES)
def test_no_default_refuses_a_legal_steps_value(name):
    """`--steps 20` failed with '--warmup-steps (30) must be less than --steps (20)', a
    flag the user never typed; `--steps 70` with '--steps must be a multiple of
    --eval-every (50)'."""
    for steps in STEPS:
        args = parse(name, ["--steps", str(steps)])
        chosen = recipe_options.settle_defaults(args)
        assert 0 <= args.warmup_steps < steps or args.warmup_steps == 0, steps
        assert args.warmup_steps <= args._defaults["warmup_steps"]
        assert steps % args.eval_every == 0, steps
        assert steps // args.eval_every <= max(20, steps // 10), steps  # not every step
        for line in chosen:  # the log says what each adapted default chose, and why
            assert line.startswith(("--warmup-steps", "--eval-every")) and "default" in line


def test_what_the_defaults_choose_is_said():
    args = parse("gpt_pretrain", ["--steps", "20"])
    assert recipe_options.settle_defaults(args) == [
        "--warmup-steps 4 (default: min(30, --steps // 5))"]
    args = parse("gpt_pretrain", ["--steps", "97"])
    assert "--eval-every 97 (default: only at the end: no divisor of --steps near it)" in \
        recipe_options.settle_defaults(args)
    args = parse("gpt_pretrain", [])
    assert recipe_options.settle_defaults(args) == []  # the usual 200 / 30 / 50
    assert (args.warmup_steps, args.eval_every) == (30, 50)


def test_a_typed_value_that_cannot_work_is_refused_naming_it():
    for name in RECIPE_MODULES:
        args = parse(name, ["--steps", "20", "--warmup-steps", "30"])
        with pytest.raises(ValueError, match=r"--warmup-steps \(30\) must be less than "
                                             r"--steps \(20\).*Pass e.g. --warmup-steps 4"):
            recipe_options.settle_defaults(args)
        args = parse(name, ["--steps", "70", "--eval-every", "50"])
        with pytest.raises(ValueError, match=r"--steps \(70\) must be a multiple of "
                                             r"--eval-every \(50\)\. Pass e.g\. --eval-every 35"):
            recipe_options.settle_defaults(args)


def test_a_setting_the_distribution_refuses_is_said_with_the_flags():
    """kdist names its keyword arguments (``pipeline_repeats=1``); a recipe user typed
    flags, so the recipe says ``--pipeline-repeats 1`` — and sets no distribution."""
    before = keras.distribution.distribution()
    args = parse("gpt_pretrain", ["--mesh", "stage=2,data=4", "--pipeline-schedule",
                                  "interleaved_1f1b"])
    with pytest.raises(ValueError, match=r"^--pipeline-schedule interleaved_1f1b runs several "
                                         r"model chunks per stage; got --pipeline-repeats 1\. "
                                         r"Use --pipeline-repeats >= 2"):
        recipe_run.set_distribution(args, "stage=2,data=4", "float32")
    args = parse("gpt_pretrain", ["--mesh", "stage=2,seq=2,data=2", "--pipeline-schedule",
                                  "zero_bubble", "--context-parallel", "ring"])
    with pytest.raises(ValueError, match=r"Use --pipeline-schedule 1f1b or 'interleaved_1f1b' "
                                         r"with ring attention, or --context-parallel "
                                         r"all_gather with zero_bubble"):
        recipe_run.set_distribution(args, "stage=2,seq=2,data=2", "float32")
    assert keras.distribution.distribution() is before


def test_the_batch_default_rounds_up_to_the_mesh_a_typed_batch_does_not():
    args = parse("gpt_pretrain", ["--grad-accum", "3"])
    assert recipe_options.settle_batch(args, 8 * 3) and args.global_batch_size == 24
    args = parse("gpt_pretrain", ["--grad-accum", "3", "--global-batch-size", "16"])
    with pytest.raises(ValueError, match=r"--grad-accum \(3\) must be a positive divisor of "
                                         r"--global-batch-size \(16\)"):
        recipe_options.check_together(args)


def test_sync_every_without_a_replica_axis_is_refused():
    """It silently wrapped the optimizer in one DiLoCo group: weights moved every H steps."""
    for mesh in ("fsdp=8", "data=8"):
        args = parse("gpt_pretrain", ["--mesh", mesh, "--sync-every", "5"])
        with pytest.raises(ValueError, match=rf"--sync-every 5 .* --mesh {mesh} has none"):
            recipe_options.check_together(args)
    recipe_options.check_together(parse("gpt_pretrain", ["--mesh", "replica=2,data=4",
                                                         "--sync-every", "5"]))
    # --mesh auto with --sync-every: the planner searches meshes with replica groups (one
    # host here: 2 groups, an emulation).
    args = parse("gpt_pretrain", ["--sync-every", "5"])
    recipe_options.check_together(args)
    from kdist.models import GPT_PRESETS, GPTCausalLM

    mesh, why = recipe_run.resolve_mesh(args, GPTCausalLM.cost_model_for(
        GPT_PRESETS["gpt-nano"]), 128, "float32")
    assert kdist.parse_mesh(mesh, 8)["replica"] == 2 and "mesh auto: replica=2" in why[0]
    # The library says so too (its tests/parallel home is being redesigned meanwhile).
    with pytest.raises(ValueError, match="names no 'replica' axis.*'replica=1,...'"):
        kdist.distribution("fsdp=8", sync_every=2)
    assert kdist.distribution("replica=1,fsdp=8", sync_every=2).config.replicas.sync_every == 2


def test_sync_every_adapts_to_a_short_run_and_a_typed_one_longer_than_it_is_refused():
    """A run shorter than --sync-every's default 50 saved the untrained model (no round
    ever ended): the default is now min(50, --steps), and says so; a typed one longer than
    the run is refused naming both flags, before kdist is needed."""
    args = parse("gpt_pretrain", ["--mesh", "replica=2,data=4", "--steps", "10"])
    assert recipe_run.settle_mesh_defaults(args, args.mesh)[-1] == (
        "--sync-every 10 (default with a replica axis in --mesh replica=2,data=4: DiLoCo "
        "groups synchronise every 50 steps, or every --steps 10 when fewer)")
    assert args.sync_every == 10
    args = parse("gpt_pretrain", ["--mesh", "replica=2,data=4", "--steps", "120"])
    recipe_run.settle_mesh_defaults(args, args.mesh)
    assert args.sync_every == 50  # the last 20 steps: a partial round, synced at step 120
    for mesh in ("replica=2,data=4", "auto"):
        args = parse("gpt_pretrain", ["--mesh", mesh, "--steps", "2", "--sync-every", "10"])
        with pytest.raises(ValueError, match=r"^--sync-every 10 is more than --steps 2: .*"
                                             r"Pass --sync-every 2 or less, or leave it out"):
            recipe_options.check_together(args)


def test_auto_without_a_pipeline_leaves_the_schedule_flags_out():
    """``--mesh auto --pipeline-microbatches 8`` on a model that needs no pipeline: auto
    searches every mesh (the flags used to empty the search of all but pipelines), and the
    distribution then gets no schedule for a mesh without stages (it used to refuse)."""
    from kdist.models import GPT_PRESETS, GPTCausalLM

    args = parse("gpt_pretrain", ["--pipeline-microbatches", "8", "--pipeline-repeats", "2"])
    recipe_options.check_together(args)
    mesh, why = recipe_run.resolve_mesh(args, GPTCausalLM.cost_model_for(
        GPT_PRESETS["gpt-nano"]), 128, "float32")
    assert kdist.parse_mesh(mesh, 8)["stage"] == 1, why
    assert why[1] == ("--pipeline-microbatches 8 and --pipeline-repeats 2 left out: the mesh "
                      "chosen has no pipeline")
    assert args.pipeline_microbatches is None and args.pipeline_repeats == 1
    recipe_run.set_distribution(args, mesh, "float32")  # what refused it
    keras.distribution.set_distribution(None)


def test_remat_takes_the_same_values_in_the_recipes_and_kdist_plan():
    plan = cli.build_parser()
    for argv, want in ((["--remat"], "block"), (["--remat", "block"], "block"),
                       (["--remat", "none"], "none"), (["--remat", "minimal"], "minimal"),
                       ([], "auto")):
        assert plan.parse_args(["plan", *argv]).remat == want
        for name in RECIPE_MODULES:
            assert parse(name, argv).remat == want, name


def test_an_accelerator_trains_the_batch_that_fits_it():
    """On a TPU the default --global-batch-size is kdist.accelerators.default_batch per device
    (the fastest measured there that fits without rematerialisation); on a CPU, and once
    typed, the recipe's own."""
    config = kdist.models.presets.preset_config(kdist.models.GPT_PRESETS, "gpt2-medium")
    args = parse("gpt_pretrain", ["--preset", "gpt2-medium", "--sequence-length", "1024"])
    assert recipe_run.device_batch(args, config) == []  # a CPU
    with kdist.accelerators.assume("TPU v5 lite"):
        lines = recipe_run.device_batch(args, config)
        devices = jax.device_count()
        assert args._defaults["global_batch_size"] == 8 * devices
        assert lines == [f"--global-batch-size {8 * devices} (8 per TPU v5 lite device, "
                         f"without rematerialisation: kdist.accelerators.default_batch)"]
        typed = parse("gpt_pretrain", ["--preset", "gpt2-medium", "--sequence-length", "1024",
                                       "--global-batch-size", "4"])
        assert recipe_run.device_batch(typed, config) == []


def test_matmul_precision_takes_every_policy_in_the_recipes_and_kdist_plan():
    """The flags' literal choices (no kdist import at parse time) are the policy's names."""
    plan = cli.build_parser()
    for name in kdist.precision.PRECISIONS:
        assert plan.parse_args(["plan", "--matmul-precision", name]).matmul_precision == name
        for recipe in RECIPE_MODULES:
            if "--matmul-precision" in flags(recipe):
                assert parse(recipe, ["--matmul-precision", name]).matmul_precision == name
    assert "--matmul-precision" in flags("gpt_pretrain")


def test_the_head_precision_flag_is_the_causal_lm_recipes_and_kdist_plans():
    """``--head-matmul-precision``: GPTCausalLM's ``head_matmul_precision``, bf16 (off) by
    default, in the GPT recipes and ``kdist plan``; the BERT recipes have no causal head."""
    plan = cli.build_parser()
    assert plan.parse_args(["plan"]).head_matmul_precision == "bf16"
    for name in kdist.precision.PRECISIONS:
        assert plan.parse_args(["plan", "--head-matmul-precision", name]) \
            .head_matmul_precision == name
        for recipe in ("gpt_pretrain", "gpt_finetune"):
            assert parse(recipe, []).head_matmul_precision == "bf16"
            assert parse(recipe, ["--head-matmul-precision", name]) \
                .head_matmul_precision == name
    assert not {"--head-matmul-precision"} & (flags("bert_pretrain") | flags("bert_finetune"))
    with pytest.raises(SystemExit):
        parse("gpt_pretrain", ["--head-matmul-precision", "int4"])
