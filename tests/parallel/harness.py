"""The parity harness: a strategy trains like one device.

Every parity test of the suite goes through :func:`assert_trains_like_one_device`, as every
keras-hub model test goes through ``run_backbone_test``:

    run = assert_trains_like_one_device("gpt", "fsdp=4,model=2", layouts=True)
    assert_trains_like_one_device("llama", "seq=4,data=2", context_parallel="ring")
    assert_trains_like_one_device("gpt", "stage=4,data=2", config=DEEP, rows=16,
                                  pipeline_microbatches=8)

A *family* (:data:`FAMILIES`) says how to build a model, feed it and take one step. The
1-device reference of a (family, config, task options, batches, optimizer, precision, seed)
is trained once per test session and memoised; each call then builds the family under
``kdist.distribution(mesh, **options)`` with the same seed, trains it on the same batches
with the same optimizer, and checks, against the reference:

- the initial weights, bit for bit (initialisation does not depend on the mesh);
- the loss of every step and every final weight, within a named :data:`TOLERANCES` entry;
- every optimizer slot (Adam's moments: the gradients' running means), float32 only — a
  gradient wrong by a constant factor barely moves Adam's update, but moves its moments;
- that the feature the options ask for really ran (the split attention under ``seq``,
  kdist's reduction for ``gradient_reduction``, the pipeline schedule under ``stage``,
  DiLoCo for ``sync_every``), so a silent fall-back to plain training cannot pass;
- that the reference itself learned (its weights moved far beyond the tolerance, and its
  loss on the first batch, evaluated before and after training, fell by the family's and
  the tolerance's floor), so a step that did nothing — or climbed — cannot pass either;
- where asked, every weight's layout (``layouts=True``).

It returns the :class:`Run` (model, losses, weights) for anything else a test asserts —
HLO collectives among them (:meth:`Run.collectives`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable
from unittest import mock

import jax
import keras
import numpy as np

import kdist
from kdist import hlo
from kdist.models import BertBackbone, BertMaskedLM, GPTBackbone, GPTCausalLM
from kdist.parallel import experts as experts_module
from kdist.parallel import pipeline
from kdist.parallel import reduction as reduction_module
from kdist.parallel.context import layer as context_layer
from tests.bert_helpers import TINY_BERT, mlm_batches
from tests.helpers import TINY_GPT, TINY_LLAMA, parity_optimizer, token_batches, weights
from tests.parallel import shared_runs
from tests.parallel.expected_layouts import TOY_AXES, assert_layouts
from tests.toy_family import HIDDEN, MLP, MLPLM, VOCAB, MLPBackbone

# --- tolerances ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How close a sharded run must stay to the reference, and why.

    ``loss_rtol`` applies to every step's loss, ``weight_atol`` to every final weight (None:
    weights are not compared, as roundings that Adam normalises differ). So that a run that
    did nothing cannot pass, the reference must move its weights by more than 50 x
    ``weight_atol`` and its loss on its first batch must fall by more than
    ``min_loss_change`` (and the family's :attr:`Family.learns`).
    ``must_differ``: the run must not equal the reference exactly (its rounding must show).
    ``slot_atol``: every optimizer slot (Adam's moments) within this times the reference's
    largest slot. Adam's update hardly changes when every gradient is scaled alike (a
    reduction that drops its 1/n: final weights within 6e-8 of the right run's on data=8),
    but its first moment is the gradient's running mean, so such a bug shows there.
    """

    loss_rtol: float
    why: str
    weight_atol: float | None = None
    min_loss_change: float = 0.0
    must_differ: bool = False
    slot_atol: float | None = None


TOLERANCES = {
    "float32": Tolerance(
        loss_rtol=2e-6, weight_atol=2e-6, slot_atol=1e-5,
        why="float32: only the order of summation differs between meshes; with "
            "parity_optimizer's epsilon=1e-3 Adam does not amplify that rounding. Slots: "
            "measured <= 5.2e-7 of the largest (gpt data=8, fsdp=4,model=2, stage=4,data=2 "
            "1F1B, seq=4,data=2; llama data=2,fsdp=2,model=2; bert fsdp=8), 1e-5 is 20x that."),
    "bfloat16": Tolerance(
        loss_rtol=2e-4, min_loss_change=0.05,
        why="mixed_bfloat16: matmuls round to bf16 (2^-9 relative) and the sharded program "
            "rounds partial sums at other points, so logits differ by a few bf16 ulps; the "
            "loss averages 128+ token losses of independent-sign errors (measured <= 2e-5 "
            "relative over 3 steps). 2e-4 (1e-3 absolute at loss 5.5) is 10x that and 50x "
            "below the 0.05 the loss must move in those steps."),
    "bfloat16_gradients": Tolerance(
        loss_rtol=1e-4, min_loss_change=0.01, must_differ=True,
        why="gradient_reduction='bfloat16' rounds each device's partial gradient by at most "
            "2^-9; Adam's normalised steps of lr 1e-2 carry that into the weights, moving the "
            "loss by ~1e-5 of itself over 3 steps (measured 2.1e-6; here 50x that)."),
    "8bit": Tolerance(
        loss_rtol=1e-3, min_loss_change=0.06, must_differ=True,
        why="8-bit codes are within 2^-4 (float8) or 1/254 of the block's peak (int8) of each "
            "value; Adam normalises the step, so 3 steps of lr 1e-2 move the loss by ~1e-5 "
            "of itself (measured 3e-5 and 1e-5; 1e-3 is 30x that). The loss must move by "
            "10x the tolerance (0.06 at loss 5.5)."),
    "int8": Tolerance(
        loss_rtol=2e-6, weight_atol=3e-4,
        why="matmul_precision='int8' where XLA's partitioner runs the step: per-token maxima "
            "are all-reduced over split axes and int32 partial sums add exactly, so losses "
            "agree as float32's (measured <= 3.5e-7 relative). But a one-ulp difference of "
            "summation order upstream can carry a value across a rounding boundary, moving "
            "its code by one (1/127 of its slice's peak); Adam (lr 1e-2, epsilon 1e-3) "
            "carries that into the weights: measured <= 6.2e-5 after 3 steps (seq=2,data=4; "
            "2.7e-5 fsdp=4,model=2). 3e-4 is 5x that; the reference moves 0.018 (60x). "
            "Slots are not compared (the same flips move them)."),
    "int8_sr": Tolerance(
        loss_rtol=4e-4, min_loss_change=0.025,
        why="matmul_precision='int8-sr' draws its gradients' rounding from a key hashed from "
            "dy's exact bits (no seed state), and a sharded dy differs from one device's in "
            "its last bits (float32 sums in another order: on fsdp=4,model=2 all 72 keys of "
            "the tiny GPT's 3 steps differed, from step 1's first), so the runs draw "
            "independent noise. With a key that ignores dy the row holds at 'int8' "
            "(losses 1.1e-6, weights 2.3e-4), and equal dy draws equal bits on any sharding "
            "(tests/precision/test_stochastic.py). So the bound is two draws': 5 runs (4 on "
            "one device, 3 of them with a salt folded into the key; the sharded one) differ "
            "pairwise by <= 8.7e-5 in loss at step 3 (sharded against one device: 4.0e-5). "
            "4e-4 is 4.6x that; the loss must move 10x it. Weights are not compared: two "
            "draws differ by up to 1.4e-3, more than 1/50 of what the reference moves."),
    "int8_rounds": Tolerance(
        loss_rtol=2e-5, weight_atol=3e-4,
        why="matmul_precision='int8' in DiLoCo groups against DiLoCo computed on one device "
            "group by group: the groups quantize the same rows, and the first round's losses "
            "are bit-equal, but its weights already differ as the int8 rows' do (2.8e-5 "
            "after round 1 on replica=2,data=4: the code flips of 'int8', where float32 "
            "differs by 6e-8). The outer step (Nesterov, lr 0.7) carries that difference "
            "into the next round's forwards, which the 'int8' rows (3 steps, no outer step) "
            "never see: losses 9.1e-7 and 3.0e-6 relative at steps 3 and 4, weights 1.2e-4. "
            "2e-5 is 7x the losses' measured difference; weights as 'int8'."),
    "int8_microbatches": Tolerance(
        loss_rtol=1e-4, min_loss_change=0.01,
        why="matmul_precision='int8' under a pipeline schedule: each microbatch's weight "
            "gradient takes its own scales (maxima over its tokens, not the batch's), so the "
            "gradients differ from one device's by int8 rounding, not float32's: measured "
            "8.4e-6 relative on the losses of stage=2,data=4 1F1B over 3 steps (weights "
            "6e-4, not compared). 1e-4 is 12x that; the loss must move 10x the tolerance."),
    "int8_experts": Tolerance(
        loss_rtol=1e-4, min_loss_change=0.01,
        why="matmul_precision='int8' MoE experts over an 'expert' axis: forwards and input "
            "gradients scale per token and per expert channel, as on one device, but a "
            "weight gradient's scales are maxima over the rows its product holds: one "
            "device's blocks of an expert's rows against the expert's whole buffer "
            "(every source device's rows) on its device. The gradients differ by int8 "
            "rounding, not float32's: measured 7.9e-6 relative on the losses of "
            "expert=2,data=4 over 3 steps (weights not compared: a token whose routing "
            "flips moves an expert's load share by 1/128). 1e-4 is 12x that; the loss "
            "must move 10x it."),
}
MOVES = 50  # the reference's weights move by more than MOVES x weight_atol

# --- families -----------------------------------------------------------------------------


def _lm_step(model, batch) -> float:
    x, y = batch
    return float(model.train_on_batch(x, y))


def _mlm_step(model, batch) -> float:
    x, y, w = batch  # (the loss alone, or with masked_accuracy: as a dict either way)
    return float(model.train_on_batch(x, y, sample_weight=w, return_dict=True)["loss"])


def _mlm_evaluate(model, batch) -> float:
    x, y, w = batch
    return float(model.test_on_batch(x, y, sample_weight=w, return_dict=True)["loss"])


def _documents(batches):
    """Token batches as packed documents: sorted random segment ids per row."""
    segments = np.sort(np.random.default_rng(1).integers(0, 4, batches[0][0].shape), axis=1)
    return [({"token_ids": x, "segment_ids": segments}, y) for x, y in batches]


@dataclasses.dataclass(frozen=True)
class Family:
    """How to build, feed and step one model family.

    ``build(config, task)`` builds the model under the active distribution (the seed is
    set by the harness); ``batches(steps, rows, config)`` gives the deterministic batches;
    ``step(model, batch)`` takes one training step and returns its loss. ``config`` is
    the family's model configuration, which a call's ``config`` overrides; ``options``
    are distribution options every run of the family needs (e.g. ``auto_shard`` for a
    foreign model); ``loss`` makes the loss to compile with (None: the task's own);
    ``layouts(model)`` asserts every weight's layout under the active distribution;
    ``evaluate(model, batch)`` is the loss of a batch without a step; ``learns``: what the
    reference's loss on its first batch must fall by from its initial to its final weights
    (the per-model guards the parity tests had before the harness: 0.05 at lr 1e-2 over 3
    steps, 0.01 for the keras-hub models, 1e-3 for the toy). The first batch, not the
    steps' losses: BERT's masked batches are random tokens, so its loss on new batches
    need not fall.
    """

    build: Callable[[dict, dict], keras.Model]
    batches: Callable[[int, int, dict], list]
    step: Callable[[keras.Model, tuple], float] = _lm_step
    evaluate: Callable[[keras.Model, tuple], float] = lambda model, batch: float(
        model.test_on_batch(*batch[:2]))
    config: dict = dataclasses.field(default_factory=dict)
    options: dict = dataclasses.field(default_factory=dict)
    loss: Callable[[], keras.losses.Loss] | None = None
    layouts: Callable[[keras.Model], None] = assert_layouts
    learns: float = 0.05


def _gpt(config, task):
    return GPTCausalLM(GPTBackbone(**config), **task)


def _bert(config, task):
    return BertMaskedLM(BertBackbone(**config), **task)


def _toy(config, task):
    model = MLPLM(MLPBackbone(**config), **task)
    model(np.zeros((1, 16), "int32"))
    return model


def _tokens(steps, rows, config):
    return token_batches(steps, batch=rows, vocab=config["vocabulary_size"])


def _documents_batches(steps, rows, config):
    return _documents(_tokens(steps, rows, config))


def _masked(steps, rows, config):
    return mlm_batches(steps, batch=rows, vocab=config["vocabulary_size"])


def _hub(kind):
    """A keras-hub backbone (GPT-2 or BERT) with its tied token table as the LM head,
    sharded by kdist's automatic rules (keras-hub declares no logical axes)."""
    import keras_hub

    def build(config, task):
        if kind == "gpt2":
            backbone = keras_hub.models.GPT2Backbone(**config)
            hidden = backbone.output
        else:
            backbone = keras_hub.models.BertBackbone(**config, num_segments=2)
            hidden = backbone.output["sequence_output"]
        return keras.Model(backbone.input, backbone.token_embedding(hidden, reverse=True))

    def batches(steps, rows, config):
        out = []
        for x, y in _tokens(steps, rows, config):
            inputs = {"token_ids": x, "padding_mask": np.ones_like(x)}
            if kind == "bert":
                inputs["segment_ids"] = np.zeros_like(x)
            out.append((inputs, y))
        return out

    def layouts(model):
        """kdist's automatic rules: the token table's embed dimension over fsdp (as kdist's
        own rules do) or its vocabulary over model; attention kernels' hidden dimension
        over fsdp, their heads over model."""
        sizes = keras.distribution.distribution().mesh_shape
        specs = {w.path: tuple(w.value.sharding.spec) for w in model.weights}
        qkv = [p for p in specs if p.endswith(("attention/query/kernel",
                                               "attention_layer/query/kernel"))]
        assert qkv, sorted(specs)
        if sizes["fsdp"] > 1:
            assert specs["token_embedding/embeddings"] == (None, "fsdp")
            assert all(specs[p][0] == "fsdp" for p in qkv)
        if sizes["model"] > 1:
            assert specs["token_embedding/embeddings"] == ("model", None)
            assert all(specs[p][:2] == (None, "model") for p in qkv)

    # BERT's pooler is neither tensor-parallel nor (without fsdp) shardable: replicated.
    allow = ["pooled_dense/kernel"] if kind == "bert" else []
    config = dict(vocabulary_size=256, num_layers=2, num_heads=4, hidden_dim=128,
                  intermediate_dim=256, max_sequence_length=32, dropout=0.0)
    return Family(build, batches, config=config,
                  options={"auto_shard": True, "allow_replicated": allow},
                  loss=lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  layouts=layouts, learns=0.01)


def _toy_layouts(model):
    """The toy's declarations through kdist's rules, and on fsdp=4,model=2 (its row) the
    specs written out, as tests/test_toy_family.py had them: a change in the rules that
    the derived check would follow shows here."""
    assert_layouts(model, TOY_AXES)
    sizes = {a: n for a, n in keras.distribution.distribution().mesh_shape.items() if n > 1}
    if sizes == {"fsdp": 4, "model": 2}:
        specs = {w.path.split("mlp_backbone/")[-1]: tuple(w.value.sharding.spec)
                 for w in model.weights}
        assert specs == {"embeddings": ("model", "fsdp"), "up/kernel": ("fsdp", "model"),
                         "up/bias": ("model",), "down/kernel": ("model", "fsdp"),
                         "down/bias": ("fsdp",)}, specs


FAMILIES: dict[str, Family] = {
    "gpt": Family(_gpt, _tokens, config=TINY_GPT),
    "gpt-documents": Family(_gpt, _documents_batches, config={**TINY_GPT, "document_mask": True}),
    # RoPE, grouped-query attention, RMSNorm, SwiGLU, untied output, no biases.
    "llama": Family(_gpt, _tokens, config=TINY_LLAMA),
    "llama-documents": Family(_gpt, _documents_batches,
                              config={**TINY_LLAMA, "document_mask": True}),
    "bert": Family(_bert, _masked, _mlm_step, _mlm_evaluate, config=TINY_BERT),
    # tests/toy_family.py: a family kdist knows only by its declarations.
    "toy": Family(_toy, _tokens, config=dict(vocabulary_size=VOCAB, hidden_dim=HIDDEN, mlp_dim=MLP),
                  layouts=_toy_layouts,
                  # A tied table of stddev 0.02 and no attention: its gradients sit below
                  # Adam's epsilon=1e-3, so 3 steps lower the first batch's loss by 1.9e-3
                  # (measured), 170x the float32 loss tolerance at loss 5.5.
                  learns=1e-3),
    "hub-gpt2": _hub("gpt2"),
    "hub-bert": _hub("bert"),
}

OPTIMIZERS: dict[str, Callable[[], keras.optimizers.Optimizer]] = {
    # Why epsilon=1e-3: tests/helpers.py. Unclipped: a global-norm clip above the gradient's
    # norm (the tiny models' first gradients exceed 1.0) rescales a gradient that is wrong
    # by a constant factor back to the right one, which would hide a reduction's lost 1/n.
    "adamw": lambda: parity_optimizer(clipnorm=None),
    # kdist's default clip (norm 1.0), active on these steps: the global norm of sharded
    # gradients (rows of tests/parallel/combinations.py with optimizer="adamw-clipped").
    "adamw-clipped": parity_optimizer,
    "sgd": lambda: keras.optimizers.SGD(0.1),
}

# --- runs ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """One training run: the model (still under its distribution), per-step losses, the
    initial and final weights (host copies, by path) and the batches it saw."""

    model: keras.Model
    losses: list[float]
    initial: dict[str, np.ndarray]
    final: dict[str, np.ndarray]
    batches: list
    distribution: object = None
    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    slots: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    first_batch: tuple[float, float] = ()  # its loss before and after training (references)

    def collectives(self, batch: int | None = None) -> list:
        """The collectives of this model's compiled train step (kdist.hlo), on a batch of
        its own batches' shape."""
        from kdist.planning.compile import compile_train_step

        keras.distribution.set_distribution(self.distribution)
        x, y = self.batches[0][:2]
        compiled, _ = compile_train_step(self.model, x, y, self.distribution)
        return hlo.parse_collectives(compiled.as_text(), 8)


def _freeze(value):
    return json.dumps(value, sort_keys=True, default=repr)


def _spies(dist, options) -> dict[str, tuple]:
    """What must run under these options: name -> (owner, attribute)."""
    sizes = dist.mesh_shape if dist is not None else {}
    spies = {}
    if sizes.get("seq", 1) > 1:
        spies["split attention"] = (context_layer, "local_attention")
    if options.get("gradient_reduction"):
        spies["kdist's gradient reduction"] = (reduction_module, "loss_and_updates")
    if sizes.get("expert", 1) > 1:  # every MoE layer's tokens through the all-to-all
        spies["the experts' all-to-all"] = (experts_module, "expert_parallel_outputs")
    if sizes.get("stage", 1) > 1:  # GPipe differentiated by JAX, or the interpreter's
        scheduled = options.get("pipeline_schedule", "gpipe") != "gpipe"
        spies["the pipeline schedule"] = (pipeline, "scheduled" if scheduled else "pipelined")
    return spies


def _traces_per_step(model) -> int:
    """How often a train step's trace calls each attention layer's code: once per block, or
    once for a scanned stack (its body is traced once for every layer)."""
    backbone = model.backbone
    return 1 if getattr(backbone, "scan_layers", False) else backbone.num_layers


class _Batches(keras.utils.PyDataset):
    """A list of batches for ``fit``, in order."""

    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, index):
        return self.batches[index]


def train_run(family: str, mesh: str | None = None, *, config: dict | None = None,
              task: dict | None = None, steps: int = 3, rows: int = 8,
              optimizer: str = "adamw", dtype_policy: str = "float32", seed: int = 0,
              devices=None, evaluate_first: bool = False, fit: bool = False,
              **options) -> Run:
    """Builds ``family`` under ``mesh`` (None: one device) and trains it for ``steps``;
    ``evaluate_first``: also the first batch's loss before and after training. ``fit``:
    the steps are one ``model.fit`` of one-step epochs (each epoch's loss is its step's),
    not a ``train_on_batch`` each."""
    fam = FAMILIES[family]
    keras.utils.clear_session()
    keras.config.set_dtype_policy(dtype_policy)
    dist = None
    if mesh is not None:
        dist = kdist.distribution(mesh, devices, **{**fam.options, **options})
    keras.distribution.set_distribution(dist)
    keras.utils.set_random_seed(seed)
    model = fam.build({**fam.config, **(config or {})}, dict(task or {}))
    initial = weights(model)
    model.compile(optimizer=OPTIMIZERS[optimizer](), **({"loss": fam.loss()} if fam.loss else {}))
    batches = fam.batches(steps, rows, {**fam.config, **(config or {})})
    calls, first = {}, ()
    if evaluate_first:
        first = (fam.evaluate(model, batches[0]),)
    with contextlib.ExitStack() as stack:
        spies = {name: stack.enter_context(mock.patch.object(owner, attr,
                                                             wraps=getattr(owner, attr)))
                 for name, (owner, attr) in _spies(dist, options).items()}
        if fit:
            history = model.fit(_Batches(batches), epochs=steps, steps_per_epoch=1,
                                shuffle=False, verbose=0)
            losses = [float(v) for v in history.history["loss"]]
        else:
            losses = [fam.step(model, batch) for batch in batches]
        calls = {name: spy.call_count for name, spy in spies.items()}
    if evaluate_first:
        first += (fam.evaluate(model, batches[0]),)
    return Run(model, losses, initial, weights(model), batches, dist, calls,
               _slots(model.optimizer), first)


def _slots(optimizer) -> dict[str, np.ndarray]:
    """The optimizer's per-weight state (Adam's moments, momentum), by path: shaped like
    a weight, so a wrong gradient shows there even where the update hides it."""
    shapes = {tuple(v.shape) for v in getattr(optimizer, "_trainable_variables", ())}
    return {f"{type(optimizer).__name__}:{v.path}": np.asarray(v.value)
            for v in optimizer.variables if len(v.shape) and tuple(v.shape) in shapes}


def diloco_reference(family: str, *, groups: int, sync_every: int,
                     outer_learning_rate: float = 0.7, outer_momentum: float = 0.9,
                     config: dict | None = None, task: dict | None = None, steps: int = 3,
                     rows: int = 8, optimizer: str = "adamw", dtype_policy: str = "float32",
                     seed: int = 0) -> Run:
    """DiLoCo on one device, written out as the paper's algorithm: ``groups`` copies of
    the model (the same initial weights), each stepping its own optimizer on its share of
    every batch (the ``replica`` axis is the batch's slowest: group g holds the g-th block
    of rows); after every ``sync_every``-th step and after the last (a partial round), the
    outer Nesterov SGD on the groups' mean change ``θ - θ_g``, and every copy goes on from
    the new ``θ``. Its losses are each step's mean over the groups, as DiLoCo logs."""
    fam = FAMILIES[family]
    full = {**fam.config, **(config or {})}
    keras.utils.clear_session()
    keras.config.set_dtype_policy(dtype_policy)
    keras.distribution.set_distribution(None)
    models = []
    for _ in range(groups):
        keras.utils.set_random_seed(seed)
        models.append(fam.build(full, dict(task or {})))
        models[-1].compile(optimizer=OPTIMIZERS[optimizer](),
                           **({"loss": fam.loss()} if fam.loss else {}))
    batches = fam.batches(steps, rows, full)
    initial, first = weights(models[0]), (fam.evaluate(models[0], batches[0]),)
    theta = [np.asarray(w.value) for w in models[0].trainable_variables]
    momenta = [np.zeros_like(t) for t in theta]
    share = rows // groups
    losses = []
    for step, batch in enumerate(batches, 1):
        losses.append(float(np.mean([
            fam.step(model, jax.tree.map(lambda a, g=g: a[g * share:(g + 1) * share], batch))
            for g, model in enumerate(models)])))
        for states in zip(*(m.non_trainable_variables for m in models)):  # kdist's rule:
            values = [np.asarray(v.value) for v in states]  # the groups' mean, every step
            if any((v != values[0]).any() for v in values):
                for v in states:
                    v.assign(np.mean(values, axis=0).astype(values[0].dtype))
        if step % sync_every and step < steps:
            continue
        for i, w in enumerate(theta):  # the paper's PyTorch SGD with Nesterov momentum
            delta = np.mean([w - np.asarray(m.trainable_variables[i].value) for m in models],
                            axis=0)
            momenta[i] = outer_momentum * momenta[i] + delta
            theta[i] = w - outer_learning_rate * (delta + outer_momentum * momenta[i])
        for model in models:
            for variable, value in zip(model.trainable_variables, theta):
                variable.assign(value)
    first += (fam.evaluate(models[0], batches[0]),)
    return Run(models[0], losses, initial, weights(models[0]), batches, first_batch=first)


_REFERENCES: dict[str, Run] = {}


def reference_run(family: str, mesh: str | None = None, diloco: dict | None = None,
                  **settings) -> Run:
    """The run of ``family`` on ``mesh`` (None: one device) with these settings and
    distribution options, trained once per test session; ``diloco``: DiLoCo on one device
    with these arguments of :func:`diloco_reference` instead."""
    key = _freeze([family, mesh, diloco, settings])
    if key not in _REFERENCES:
        def compute() -> Run:
            run = (diloco_reference(family, **diloco, **settings) if diloco else
                   train_run(family, mesh, evaluate_first=True, **settings))
            run.model = run.distribution = None  # keep the numbers, not the model
            keras.utils.clear_session()
            return run

        # Trained once per session, not once per xdist worker (tests/parallel/shared_runs.py)
        _REFERENCES[key] = shared_runs.shared(key, compute)
    return _REFERENCES[key]


def _same_shape(value, like, path):
    if value.shape != like.shape:  # a circular pipeline's (R, L/R, ...) view of (L, ...)
        assert value.size == like.size, (path, value.shape, like.shape)
        value = value.reshape(like.shape)
    return value


def assert_trains_like_one_device(family: str, mesh: str, *, tolerance: str = "float32",
                                  layouts: bool = False, config: dict | None = None,
                                  task: dict | None = None, steps: int = 3, rows: int = 8,
                                  optimizer: str = "adamw", dtype_policy: str | None = None,
                                  seed: int = 0, devices=None, like: dict | None = None,
                                  fit: bool = False, **options) -> Run:
    """Trains ``family`` on ``mesh`` and on one device and checks they are the same
    training (see the module docstring); returns the sharded :class:`Run`.

    ``like={"mesh": ..., **options}`` compares with that run instead of one device: for a
    strategy whose exact equal is not one device (DiLoCo with AdamW inside its groups) but
    another strategy already shown to train like one device in its special case.
    ``like={"diloco": {"groups": G, "sync_every": H}}`` compares with DiLoCo computed on one
    device (:func:`diloco_reference`). ``fit``: the run trains with ``model.fit``.
    """
    tol = TOLERANCES[tolerance]
    dtype_policy = dtype_policy or ("mixed_bfloat16" if tolerance == "bfloat16" else "float32")
    settings = dict(config=config, task=task, steps=steps, rows=rows, optimizer=optimizer,
                    dtype_policy=dtype_policy, seed=seed)
    like = dict(like or {})
    reference = reference_run(family, like.pop("mesh", None), **settings, **like)
    moved = max(np.abs(reference.final[p] - reference.initial[p]).max()
                for p in reference.initial)
    assert moved > MOVES * (tol.weight_atol or 2e-6), f"the reference barely trained: {moved}"
    floor = max(tol.min_loss_change, FAMILIES[family].learns)
    before, after = reference.first_batch
    assert before - after > floor, (
        f"the reference's loss on its first batch went from {before} to {after}, a fall of "
        f"no more than {floor}")

    run = train_run(family, mesh, devices=devices, fit=fit, **settings, **options)
    for name, count in run.calls.items():
        per_layer = name in ("split attention", "the experts' all-to-all")
        traces = _traces_per_step(run.model) if per_layer else 1
        assert count >= traces, f"{name} ran {count} times, not {traces}, under {mesh} {options}"
    if options.get("sync_every"):
        assert type(run.model.optimizer).__name__ == "DiLoCo"
    if dtype_policy == "mixed_bfloat16":  # the sharded model computes in bfloat16 and
        # keeps float32 weights (tests/models/test_gpt.py checks one device's)
        assert run.model.dtype_policy.compute_dtype == "bfloat16", run.model.dtype_policy
        low = [w.path for w in run.model.weights
               if "float" in str(w.dtype) and str(w.dtype) != "float32"]
        assert not low, f"weights not kept in float32 under mixed_bfloat16 on {mesh}: {low}"
    assert sorted(run.initial) == sorted(reference.initial)
    for path, value in reference.initial.items():
        np.testing.assert_array_equal(_same_shape(run.initial[path], value, path), value,
                                      err_msg=f"initial {path}")
    np.testing.assert_allclose(run.losses, reference.losses, rtol=tol.loss_rtol,
                               err_msg=f"losses on {mesh} {options}")
    if tol.must_differ:
        assert run.losses != reference.losses, "expected the rounding to show"
    if tol.weight_atol is not None:
        for path, value in reference.final.items():
            np.testing.assert_allclose(_same_shape(run.final[path], value, path), value,
                                       rtol=0, atol=tol.weight_atol, err_msg=path)
    # Slots are keyed by optimizer class: DiLoCo's are its outer state, not comparable with
    # a plain optimizer's (its rows against one device are SGD's, whose update is the
    # gradient: the weights check it); DiLoCo against DiLoCo compares them.
    same_optimizer = {k.split(":")[0] for k in run.slots} == {
        k.split(":")[0] for k in reference.slots}
    if tol.slot_atol is not None and reference.slots and same_optimizer:
        assert sorted(run.slots) == sorted(reference.slots)
        largest = max(np.abs(v).max() for v in reference.slots.values())
        for path, value in reference.slots.items():
            np.testing.assert_allclose(_same_shape(run.slots[path], value, path), value,
                                       rtol=0, atol=tol.slot_atol * largest,
                                       err_msg=f"optimizer slot {path}")
    if layouts:
        FAMILIES[family].layouts(run.model)
    return run
