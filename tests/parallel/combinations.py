"""The combination table: every mesh and distribution option kdist builds or refuses, as
data, one row a line. ``tests/parallel/test_combinations.py`` runs each row (a row that
trains goes through the parity harness for each of its families; a refused one must fail
with its message before anything compiles), and checks the README's combination matrix
against what the rows show.

A new combination is one more row: ``trains(mesh, families, **distribution_options)`` or
``refused(mesh, message, **distribution_options)``; ``config``/``task`` override the
model's and task's arguments, ``rows``/``steps``/``optimizer``/``tolerance`` the run's.
"""

from __future__ import annotations

import dataclasses

from tests.helpers import TINY_GPT


@dataclasses.dataclass(frozen=True)
class Row:
    mesh: str
    families: tuple[str, ...] = ()
    options: dict = dataclasses.field(default_factory=dict)  # kdist.distribution(...)
    run: dict = dataclasses.field(default_factory=dict)  # the harness' run settings
    refusal: str | None = None  # the regex the ValueError must match; None: it trains
    refuses: tuple[str, str] = ()  # the pair a refusal is about: axes, "reduction", "8-bit"

    @property
    def id(self) -> str:
        """The mesh, then every setting as k=v (a task's and a like-run's spelled out)."""
        settings = {k: v for k, v in {**self.options, **self.run}.items()
                    if k not in ("task", "like", "slow")}
        if isinstance(self.run.get("config"), dict):
            settings.update(settings.pop("config"))
        settings.update(self.run.get("task", {}))
        if "like" in self.run:
            settings["like"] = ",".join(f"{k}={v}" for k, v in self.run["like"].items())
        return "+".join([self.mesh, *(f"{k}={v}" for k, v in settings.items())])

    def settings(self) -> dict:
        """The harness' keyword arguments: run settings, named configs resolved, options."""
        run = dict(self.run)
        if isinstance(run.get("config"), str):
            run["config"] = CONFIGS[run["config"]]
        run.pop("slow", None)
        return {**run, **self.options}


RUN_SETTINGS = ("config", "task", "steps", "rows", "optimizer", "tolerance", "layouts",
                "devices", "slow", "like")


def trains(mesh: str, families: str, **settings) -> Row:
    """``families``: space-separated names of tests/parallel/harness.FAMILIES."""
    run = {k: v for k, v in settings.items() if k in RUN_SETTINGS}
    options = {k: v for k, v in settings.items() if k not in RUN_SETTINGS}
    return Row(mesh, tuple(families.split()), options, run)


def refused(mesh: str, pair: str, message: str, **options) -> Row:
    """``pair``: the two things that do not combine, e.g. ``"stage x seq"``."""
    a, b = pair.split(" x ")
    return Row(mesh, options=options, refusal=message, refuses=(a, b))


CONFIGS = {
    # A deeper GPT, its blocks one scanned stack: 1, 2 or 4 layers per pipeline stage.
    "deep": {**TINY_GPT, "num_layers": 8, "scan_layers": True},
    "scanned": {"scan_layers": True},
    "scanned-4": {"scan_layers": True, "num_layers": 4},  # 2 stages x 2 chunks
    "deep-dropout": {**TINY_GPT, "num_layers": 8, "scan_layers": True, "dropout": 0.1},
    # Mixture of Experts (kdist.models.moe): 8 small experts, top-2, dropless, every block.
    "moe": {"moe": {"num_experts": 8, "experts_per_token": 2, "expert_dim": 32}},
    # ... GELU experts (a GPT MLP's form, two matrices: up, down) and a shared expert
    "moe-gelu": {"moe": {"num_experts": 8, "experts_per_token": 2, "expert_dim": 32,
                         "activation": "gelu", "shared_experts": 1}},
    # ... with DeepSeek-V3's balance bias: the same choices on every device (global load).
    "moe-bias": {"moe": {"num_experts": 8, "experts_per_token": 2, "expert_dim": 32,
                         "balance_bias_rate": 0.01}},
    # ... in a scanned stack: each layer's statistics and bias a row of the stack's.
    "moe-scanned": {"scan_layers": True, "moe": {"num_experts": 8, "experts_per_token": 2,
                                                 "expert_dim": 32, "balance_bias_rate": 0.01}},
    # ... in a pipeline (4 layers: 2 per stage), where each microbatch's load-balance loss is
    # its own (Megatron-LM's rule; tests/parallel/test_moe_pipeline.py shows it): the loss
    # off here, so that one device's batch is the reference (the z-loss, a mean over tokens,
    # and the bias, moved by the batch's counts, are the batch's under any microbatching).
    "moe-pipeline": {**TINY_GPT, "num_layers": 4, "scan_layers": True,
                     "moe": {"num_experts": 8, "experts_per_token": 2, "expert_dim": 32,
                             "balance_bias_rate": 0.01, "aux_loss_weight": 0.0}},
}
# DiLoCo's exact special case: inner SGD, every step synchronised, outer lr 1 and no
# momentum is synchronous data-parallel SGD, i.e. one device's SGD.
EXACT_DILOCO = dict(sync_every=1, outer_learning_rate=1.0, outer_momentum=0.0, optimizer="sgd",
                    steps=4)
# DiLoCo (AdamW inside, H = 2) over 2 rounds, against data-parallel groups.
DILOCO_LIKE = dict(sync_every=2, steps=4, like={"mesh": "replica=2,data=4", "sync_every": 2})

TABLE: list[Row] = [
    # --- data, fsdp, model: XLA's partitioner reduces the gradients -----------------------
    trains("data=8", "gpt bert", layouts=True),
    trains("fsdp=8", "gpt llama bert hub-gpt2 hub-bert", layouts=True),
    trains("model=2", "hub-gpt2 hub-bert", devices=2, layouts=True, slow=True),
    trains("fsdp=4,model=2", "gpt toy", layouts=True),
    trains("data=2,model=4", "gpt", layouts=True),
    trains("data=4,model=2", "bert", layouts=True),
    trains("model=2,data=-1", "llama"),
    trains("data=2,fsdp=2,model=2", "gpt llama bert", layouts=True),
    trains("data=2,fsdp=2,model=2", "gpt", tolerance="bfloat16"),
    # kdist's global-norm clip (active here) over sharded gradients, on each gradient path
    trains("data=2,fsdp=2,model=2", "gpt llama", optimizer="adamw-clipped"),
    # --- explicit gradient reduction (kdist.parallel.reduction) ---------------------------
    trains("data=8", "gpt", gradient_reduction="float32"),
    trains("fsdp=8", "gpt", gradient_reduction="float32"),
    trains("data=2,fsdp=4", "gpt", gradient_reduction="float32"),
    trains("data=2,fsdp=4", "gpt", gradient_reduction="float32", optimizer="adamw-clipped"),
    trains("data=2,fsdp=4", "llama", gradient_reduction="float32", task={"loss_chunk_size": 8}),
    trains("fsdp=8", "gpt", gradient_reduction="float32", config={"attention_chunk_size": 8}),
    trains("fsdp=4,model=2", "gpt", gradient_reduction="float32"),
    trains("fsdp=4,model=2", "bert", gradient_reduction="float32", config={"dropout": 0.1}),
    trains("data=2,fsdp=2,model=2", "gpt", gradient_reduction="float32"),
    # Each device draws its rows of the global dropout mask: the 1-device run's masks.
    trains("data=2,fsdp=2,model=2", "gpt", gradient_reduction="float32",
           config={"dropout": 0.1}),
    # fsdp=8 in bfloat16: tests/parallel/test_reduction.py (that it is not float32's).
    trains("data=2,fsdp=2,model=2", "gpt", gradient_reduction="int8", tolerance="8bit"),
    # float8 with error feedback on data=2,fsdp=4: tests/parallel/test_reduction.py.
    # --- matmul_precision='int8' (kdist.precision): one device's int8 training -----------
    trains("fsdp=4,model=2", "gpt", config={"matmul_precision": "int8"}, tolerance="int8"),
    # int8-sr draws its rounding from dy's bits, which differ from one device's in the last
    # bit: the losses agree as two stochastic roundings' (harness.TOLERANCES['int8_sr']).
    trains("fsdp=4,model=2", "gpt", config={"matmul_precision": "int8-sr"},
           tolerance="int8_sr"),
    trains("seq=2,data=4", "gpt", config={"matmul_precision": "int8"}, tolerance="int8"),
    # The vocabulary head quantized (head_matmul_precision), in the fused loss (chunks of 8)
    # with its vocabulary over model: each device quantizes its shard's products, the
    # scales' maxima reduced over model (grad_h) and fsdp (grad_table) so they are one
    # device's (kdist.models.losses). Measured: losses 1.7e-7, weights 1.5e-6 (with each
    # device's own maxima instead: 6.2e-4 and 1.0e-2, which 'int8' refuses). The blocks'
    # int8 stay off here: their code flips (weights 2.7e-5 apart) move the quantized head's
    # codes in turn (losses 2.1e-5, weights 2.2e-4 with both on), beyond 'int8''s losses.
    trains("fsdp=4,model=2", "gpt", task={"head_matmul_precision": "int8", "loss_chunk_size": 8},
           tolerance="int8"),
    trains("stage=2,data=4", "gpt", config={**CONFIGS["scanned"], "matmul_precision": "int8"},
           pipeline_schedule="1f1b", tolerance="int8_microbatches", slow=True),
    # DiLoCo groups each quantize their own rows, as DiLoCo on one device does group by group.
    trains("replica=2,data=4", "gpt", config={"matmul_precision": "int8"},
           tolerance="int8_rounds", sync_every=2, steps=4,
           like={"diloco": {"groups": 2, "sync_every": 2}}),
    # 8-bit exchange quantizes communication, int8 matmuls compute: both at once (each
    # device scales its own tokens' weight gradients: within the 8-bit tolerance).
    trains("data=2,fsdp=2,model=2", "gpt", config={"matmul_precision": "int8"},
           gradient_reduction="int8", tolerance="8bit"),
    # --- stage: pipelines over a scanned layer stack --------------------------------------
    trains("stage=8", "gpt", config="deep", rows=16),  # 1 layer per stage, M = S = 8
    trains("stage=4,data=2", "gpt", config="deep", rows=16, pipeline_microbatches=8),  # M = 2S
    trains("stage=4,data=2", "gpt", config="deep", rows=16, optimizer="adamw-clipped"),
    trains("stage=2,fsdp=2,model=2", "gpt", config="deep", rows=16),
    trains("stage=4,fsdp=2", "gpt", config="deep", rows=16, pipeline_repeats=2),  # circular
    trains("stage=2,data=4", "llama", config="scanned", rows=16, task={"loss_chunk_size": 8}),
    trains("stage=2,data=4", "bert", config="scanned"),
    trains("stage=4,data=2", "gpt", config="deep", rows=16, tolerance="bfloat16"),
    # 1F1B and interleaved 1F1B (kdist.parallel.pipeline.interpreter: the loss inside the schedule)
    trains("stage=4,data=2", "gpt llama", config="deep", rows=16, pipeline_microbatches=8,
           pipeline_schedule="1f1b"),
    trains("stage=4,data=2", "gpt", config="deep", rows=16, pipeline_microbatches=8,
           pipeline_repeats=2, pipeline_schedule="interleaved_1f1b"),
    trains("stage=2,data=4", "llama-documents", config="deep", rows=16, pipeline_repeats=2,
           pipeline_schedule="interleaved_1f1b"),
    trains("stage=4,data=2", "gpt", config="deep", rows=16, pipeline_schedule="1f1b",
           tolerance="bfloat16"),
    # With dropout, GPipe's masks (the same per microbatch) are not one device's: 1F1B
    # draws GPipe's.
    trains("stage=4,data=2", "gpt", config="deep-dropout", rows=16, pipeline_microbatches=8,
           pipeline_schedule="1f1b", like={"mesh": "stage=4,data=2", "pipeline_microbatches": 8}),
    # The interpreter's region splits weights over stage and fsdp (model: XLA's).
    trains("stage=2,fsdp=4", "gpt llama", config="deep", rows=16, pipeline_microbatches=4,
           pipeline_schedule="1f1b"),
    trains("stage=2,data=2,fsdp=2", "gpt", config="deep", rows=16, pipeline_microbatches=4,
           pipeline_repeats=2, pipeline_schedule="interleaved_1f1b"),
    # BERT's masked-LM loss (sample-weighted) inside the schedule
    trains("stage=2,data=4", "bert", config="scanned", pipeline_schedule="1f1b"),
    trains("stage=2,data=4", "bert", config="scanned-4", pipeline_repeats=2,
           pipeline_schedule="interleaved_1f1b"),
    # model stays with XLA inside every stage (as under GPipe)
    trains("stage=2,fsdp=2,model=2", "gpt llama", config="deep", rows=16,
           pipeline_microbatches=4, pipeline_schedule="1f1b"),
    trains("stage=2,fsdp=2,model=2", "gpt llama", config="deep", rows=16,
           pipeline_microbatches=4, pipeline_repeats=2, pipeline_schedule="interleaved_1f1b"),
    # bfloat16 with model inside the stage (XLA:CPU aborted compiling its bfloat16 sum over
    # stage in a partly manual region: kdist/parallel/interpreter.py)
    trains("stage=2,fsdp=2,model=2", "gpt", config="deep", rows=16, pipeline_microbatches=4,
           pipeline_schedule="1f1b", tolerance="bfloat16"),
    # zero-bubble (ZB-H1): the backward split into I and W, W filling the bubble
    trains("stage=4,data=2", "gpt llama", config="deep", rows=16, pipeline_microbatches=8,
           pipeline_schedule="zero_bubble"),
    trains("stage=2,fsdp=2,model=2", "gpt llama", config="deep", rows=16,
           pipeline_microbatches=4, pipeline_schedule="zero_bubble"),
    trains("stage=2,data=4", "bert", config="scanned", pipeline_schedule="zero_bubble"),
    trains("stage=4,data=2", "gpt", config="deep", rows=16, pipeline_schedule="zero_bubble",
           tolerance="bfloat16"),
    # schedules x seq: every stage, and the loss, on its share of the tokens; with ring
    # attention every stage runs each tick's kind of task (kdist/parallel/every_stage.py)
    trains("stage=2,seq=2,data=2", "gpt llama-documents", config="deep", rows=16,
           context_parallel="ring", pipeline_schedule="1f1b"),
    trains("stage=2,seq=4", "gpt-documents", config="deep", rows=16, context_parallel="ring",
           pipeline_schedule="interleaved_1f1b", pipeline_repeats=2),
    trains("stage=2,seq=2,data=2", "gpt", config="deep", rows=16, context_parallel="ring",
           pipeline_schedule="1f1b", tolerance="bfloat16"),
    trains("stage=2,seq=2,model=2", "llama", config="deep", rows=16, context_parallel="ring",
           pipeline_schedule="1f1b"),
    trains("stage=2,seq=2,data=2", "gpt", config="deep", rows=16, context_parallel="ring",
           pipeline_schedule="1f1b", gradient_reduction="float32"),
    trains("replica=2,stage=2,seq=2", "gpt", config="deep", rows=16, context_parallel="ring",
           pipeline_schedule="1f1b", **EXACT_DILOCO),
    trains("stage=2,seq=2,data=2", "gpt", config="deep", rows=16,
           context_parallel="all_gather", pipeline_schedule="1f1b"),
    trains("stage=2,seq=2,fsdp=2", "gpt-documents llama-documents", config="deep", rows=16,
           context_parallel="all_gather", pipeline_schedule="zero_bubble"),
    trains("stage=2,seq=4", "gpt", config="deep", rows=16, context_parallel="all_gather",
           pipeline_schedule="interleaved_1f1b", pipeline_repeats=2),
    trains("stage=2,seq=2,model=2", "llama", config="deep", rows=16,
           context_parallel="all_gather", pipeline_schedule="1f1b"),
    trains("stage=2,seq=2,data=2", "gpt", config="deep", rows=16, context_parallel="all_gather",
           pipeline_schedule="1f1b", gradient_reduction="float32"),
    trains("replica=2,stage=2,seq=2", "gpt", config="deep", rows=16,
           context_parallel="all_gather", pipeline_schedule="1f1b", **EXACT_DILOCO),
    # a schedule per DiLoCo group: the interpreter's region nested in the group's
    trains("replica=2,stage=2,data=2", "gpt", config="deep", rows=16, pipeline_schedule="1f1b",
           **EXACT_DILOCO),
    trains("replica=2,stage=2,data=2", "llama", config="deep", rows=16,
           pipeline_schedule="zero_bubble", **DILOCO_LIKE),
    trains("replica=2,stage=2,fsdp=2", "gpt", config="deep", rows=16,
           pipeline_schedule="interleaved_1f1b", pipeline_repeats=2, **DILOCO_LIKE),
    # kdist's reduction around a schedule: the interpreter's region nested in the
    # per-device loss, each weight's gradient leaving through the reduction's collective
    trains("stage=4,data=2", "gpt", config="deep", rows=16, pipeline_schedule="1f1b",
           gradient_reduction="float32"),
    trains("stage=2,fsdp=2,model=2", "llama", config="deep", rows=16,
           pipeline_microbatches=4, pipeline_schedule="zero_bubble",
           gradient_reduction="float32"),
    trains("stage=2,data=4", "bert", config="scanned-4", pipeline_repeats=2,
           pipeline_schedule="interleaved_1f1b", gradient_reduction="bfloat16",
           tolerance="bfloat16_gradients"),
    trains("stage=2,fsdp=4", "gpt", config="deep", rows=16, pipeline_schedule="1f1b",
           gradient_reduction="int8", tolerance="8bit", steps=8),
    # kdist's reduction around the pipeline: the stages' region nested in the per-device loss
    trains("stage=2,fsdp=2,model=2", "gpt", config="deep", rows=16, gradient_reduction="float32"),
    trains("stage=4,data=2", "gpt llama", config="deep", rows=16, gradient_reduction="float32"),
    trains("stage=2,data=4", "bert", config="scanned", gradient_reduction="float32"),
    trains("stage=2,fsdp=2,model=2", "gpt", config="deep", rows=16,
           gradient_reduction="bfloat16", tolerance="bfloat16_gradients"),
    trains("stage=4,data=2", "gpt", config="deep", rows=16, gradient_reduction="bfloat16",
           tolerance="bfloat16_gradients"),
    trains("stage=2,data=4", "gpt", config="deep", rows=16, gradient_reduction="int8",
           tolerance="8bit"),
    # --- seq: context parallelism (every mesh meets both variants, with and without
    # documents; tests/parallel/test_context.py checks each variant x layout x mask per op)
    trains("seq=8", "gpt llama-documents", context_parallel="all_gather"),
    trains("seq=8", "gpt-documents", context_parallel="ring"),
    trains("seq=8", "llama", context_parallel="ring", gradient_reduction="float32"),
    trains("seq=4,data=2", "gpt llama-documents", context_parallel="ring"),
    trains("seq=4,data=2", "gpt", context_parallel="ring", optimizer="adamw-clipped"),
    trains("seq=4,data=2", "llama", context_parallel="all_gather"),
    trains("seq=4,data=2", "gpt-documents", context_parallel="all_gather",
           gradient_reduction="float32"),
    trains("seq=4,data=2", "gpt", context_parallel="all_gather", gradient_reduction="bfloat16",
           tolerance="bfloat16_gradients"),
    trains("seq=4,data=2", "bert", context_parallel="all_gather"),  # padding masks
    trains("seq=4,data=2", "bert", context_parallel="ring"),
    trains("seq=4,data=2", "llama-documents", context_parallel="ring", config="scanned"),
    trains("seq=4,data=2", "llama", context_parallel="ring", tolerance="bfloat16"),
    trains("seq=2,fsdp=2,model=2", "gpt llama-documents", context_parallel="ring"),
    trains("seq=2,fsdp=2,model=2", "gpt-documents llama", context_parallel="all_gather"),
    trains("seq=2,fsdp=2,model=2", "gpt", context_parallel="ring", gradient_reduction="float32"),
    trains("seq=2,fsdp=4", "gpt", context_parallel="ring", gradient_reduction="int8",
           tolerance="8bit"),
    trains("seq=2,fsdp=4", "gpt", context_parallel="all_gather", gradient_reduction="float8",
           error_feedback=True, tolerance="8bit"),
    # --- stage x seq: each stage's tokens split over seq ------------------------------------
    trains("stage=2,seq=2,fsdp=2", "gpt llama-documents", config="deep", rows=16,
           context_parallel="ring"),
    trains("stage=2,seq=2,fsdp=2", "bert", config="scanned", context_parallel="all_gather"),
    trains("stage=2,seq=2,model=2", "gpt llama", config="deep", rows=16,
           context_parallel="all_gather"),
    trains("stage=2,seq=4", "gpt", config="deep", rows=16, context_parallel="ring"),
    trains("stage=2,seq=4", "llama-documents", config="deep", rows=16,
           context_parallel="all_gather"),
    trains("stage=2,seq=2,fsdp=2", "gpt", config="deep", rows=16, context_parallel="ring",
           pipeline_repeats=2),  # circular repeats under seq
    trains("stage=2,seq=2,data=2", "gpt", config="deep", rows=16, context_parallel="ring",
           gradient_reduction="float32"),
    # --- replica: DiLoCo groups -------------------------------------------------------------
    trains("replica=2,fsdp=4", "gpt", config={"dropout": 0.1}, **EXACT_DILOCO),
    trains("replica=2,data=2,model=2", "gpt", **EXACT_DILOCO),
    trains("replica=2,fsdp=4", "gpt", gradient_reduction="float32", **EXACT_DILOCO),
    # 8-bit codes inside each group: DiLoCo (AdamW inside, H = 2) as with float32 exchange.
    # (8 steps, 4 rounds: the float32 run's loss must move by 10x the 8-bit tolerance.)
    trains("replica=2,data=4", "gpt", gradient_reduction="int8", tolerance="8bit", sync_every=2,
           steps=8, like={"mesh": "replica=2,data=4", "sync_every": 2}),
    # One group with a plain average is plain training (fsdp=8: tests/parallel/test_replicas.py)
    trains("replica=1,seq=2,fsdp=4", "llama", context_parallel="ring", sync_every=2, steps=4,
           outer_learning_rate=1.0, outer_momentum=0.0),
    # DiLoCo whose groups are pipelines or split sequences computes what DiLoCo with
    # data-parallel groups computes (the same rows per group), over 2 rounds.
    trains("replica=2,stage=2,data=2", "gpt", config="deep", rows=16, **DILOCO_LIKE),
    trains("replica=2,seq=2,fsdp=2", "gpt llama-documents", context_parallel="ring",
           **DILOCO_LIKE),
    trains("replica=2,stage=2,seq=2", "gpt", config="deep", rows=16, **DILOCO_LIKE),
    trains("replica=2,stage=2,seq=2", "gpt", config="deep", rows=16, **EXACT_DILOCO),
    # --- expert: MoE layers' tokens to their experts' devices by all-to-all -----------------
    trains("expert=2,data=4", "gpt", config="moe", layouts=True),
    trains("expert=2,data=4", "gpt", config="moe-bias"),
    trains("expert=4,fsdp=2", "llama", config="moe", layouts=True),
    trains("data=2,fsdp=2,model=2", "gpt", config="moe", layouts=True),  # no expert axis
    trains("expert=2,model=2,data=2", "gpt", config="moe-gelu", layouts=True),
    trains("expert=4,fsdp=2", "gpt", config="moe-scanned"),
    trains("expert=2,fsdp=4", "llama", config="moe", tolerance="bfloat16"),  # mixed precision
    trains("expert=2,data=4", "gpt", config={**CONFIGS["moe"], "matmul_precision": "int8"},
           tolerance="int8_experts"),
    # a pipeline's stages: every expert weight whole in the stage, each device its experts
    trains("expert=2,stage=2,data=2", "gpt", config="moe-pipeline", rows=16,
           pipeline_schedule="1f1b"),
    trains("expert=2,stage=2,data=2", "llama", config="moe-pipeline", rows=16,
           pipeline_schedule="zero_bubble"),  # (GPipe: tests/parallel/test_moe_pipeline.py)
    trains("expert=2,seq=2,data=2", "gpt", config="moe", context_parallel="ring"),
    trains("expert=2,seq=2,data=2", "llama", config="moe", context_parallel="all_gather"),
    # Each DiLoCo group routes its own rows (its load-balance loss is the group's), as
    # DiLoCo on one device does group by group.
    trains("replica=2,expert=2,data=2", "gpt", config="moe", sync_every=2, steps=4,
           like={"diloco": {"groups": 2, "sync_every": 2}}),
    trains("replica=2,expert=2,data=2", "llama", config="moe-bias", sync_every=2, steps=4,
           like={"diloco": {"groups": 2, "sync_every": 2}}),
    # kdist's per-device loss: each MoE layer sums its counts and its losses' sums over the
    # devices, so losses, load and bias are the batch's; with 'expert', the expert weights
    # enter whole and each device computes its own experts' tokens
    trains("data=8", "gpt", config="moe-bias", gradient_reduction="float32"),
    trains("expert=2,data=4", "gpt", config="moe-bias", gradient_reduction="float32"),
    trains("expert=2,fsdp=4", "llama", config="moe", gradient_reduction="int8",
           tolerance="8bit"),
    # ... and in a 1F1B pipeline's stages (each stage its layers' statistics, the same on
    # every device of the rows: typed so when they leave the schedule)
    trains("expert=2,stage=2,data=2", "gpt", config="moe-pipeline", rows=16,
           pipeline_schedule="1f1b", gradient_reduction="float32"),
    # --- a variant's own rule: zero-bubble's mixed ticks x ring attention's permutes ----
    refused("stage=2,seq=2,data=2", "zero_bubble x ring",
            "pipeline_schedule='zero_bubble' runs ticks that mix .* Use "
            "pipeline_schedule='1f1b' or 'interleaved_1f1b' with ring attention",
            pipeline_schedule="zero_bubble", context_parallel="ring"),
]
