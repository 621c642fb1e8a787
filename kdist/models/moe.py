"""A Mixture-of-Experts feed-forward layer: routed SwiGLU (or GELU) experts, dropless by
default.

Shapes: N tokens (B x T flattened), D hidden, E experts, k experts per token, F each
expert's width, C an expert's capacity (the capacity path), A = N x k assignments.

Dropless (the default and the reference): the A assignments are sorted by expert and each
expert's contiguous group goes through its weights with one grouped matmul
(``jax.lax.ragged_dot``), so no token is ever dropped and no FLOP is spent on padding.
``capacity_factor``: each expert takes at most ``C = ceil(capacity_factor x A / E)``
assignments, earlier tokens first, into a fixed ``(E, C, D)`` buffer (the shape an
all-to-all over the ``expert`` mesh axis moves); assignments beyond ``C`` are dropped
(their token keeps only its residual and the other experts) and counted in
``dropped_tokens``. With no overflow both paths compute the same function.

The layer's ``call`` adds the load-balance and z-losses (:mod:`kdist.models.router`,
times their coefficients) to the model's loss in training, and records the last batch's
expert load (share of assignments per expert) and dropped count in two non-trainable
variables (:func:`expert_load`). With ``balance_bias_rate`` > 0 it also keeps DeepSeek-V3's
auxiliary-loss-free balance bias (sec. 2.1.2): a per-expert bias added to the router's
scores for the choice of the k experts only, and after each training step moved by
``rate x sign(mean load - load_e)`` (an overloaded expert becomes less likely). A block
that rematerialises uses :meth:`forward` (pure, returning the statistics) inside its
checkpoint and :meth:`record` outside it.

Example:
    >>> layer = MoEFeedForward(num_experts=4, experts_per_token=2, expert_dim=32)
    >>> layer(keras.ops.ones((2, 8, 16))).shape
    (2, 8, 16)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import keras
from keras import layers, ops

from kdist import _keras_compat
from kdist.models.expert_compute import capacity_limited, dropless
from kdist.models.router import ROUTERS, load_balance_loss, route, z_loss
from kdist.models.scan import in_microbatches, stacking_default
from kdist.parallel import experts as experts_module
from kdist.parallel import region
from kdist.parallel.experts import expert_counts, expert_mlp
from kdist.parallel.layout import check_divisible
from kdist.parallel.mesh import batch_axes
from kdist.parallel.rules import add_weight
from kdist.precision import matmul as quantized
from kdist.precision.policy import check as check_precision

# What a block's `moe` dict may hold, with defaults (GPTBackbone's `moe` argument).
MOE_DEFAULTS = dict(num_experts=None, experts_per_token=2, expert_dim=None, every=1,
                    router="softmax", shared_experts=0, capacity_factor=None,
                    aux_loss_weight=0.01, z_loss_weight=0.001, balance_bias_rate=0.0,
                    renormalize=True, routed_scale=1.0, activation="swiglu")
EXPERT_ACTIVATIONS = ("swiglu", "gelu")  # kdist.parallel.experts.expert_mlp


class MoEStats(NamedTuple):
    """One MoE call's statistics: the two losses (unweighted), each expert's share of the
    assignments ``(E,)``, how many assignments the capacity dropped, (with a balance
    bias) ``sign(mean count - count_e)`` ``(E,)``, the bias's step direction, and the
    assignments per expert ``(E,)``."""

    aux_loss: jax.Array
    z_loss: jax.Array
    load: jax.Array
    dropped: jax.Array
    balance: jax.Array | None = None
    counts: jax.Array | None = None  # (E,) float32 assignments per expert


def check_moe(moe: dict | None, num_layers: int, intermediate_dim: int,
              scan_layers: bool | None = False) -> dict | None:
    """``moe`` with :data:`MOE_DEFAULTS` filled in, or a ``ValueError`` naming what is wrong.
    ``scan_layers``: the backbone's (a scanned stack holds one kind of block: MoE in every
    one).

    Example:
        >>> check_moe({"num_experts": 8}, 4, 64)["experts_per_token"]
        2
    """
    if moe is None:
        return None
    if not isinstance(moe, dict):
        raise TypeError(f"moe must be a dict such as {{'num_experts': 8}} or None; got "
                        f"{type(moe).__name__}.")
    unknown = set(moe) - set(MOE_DEFAULTS)
    if unknown:
        raise ValueError(f"moe has unknown keys {sorted(unknown)}; known: "
                         f"{sorted(MOE_DEFAULTS)}.")
    moe = {**MOE_DEFAULTS, "expert_dim": intermediate_dim, **moe}
    if moe["expert_dim"] is None:
        moe["expert_dim"] = intermediate_dim
    experts, k = moe["num_experts"], moe["experts_per_token"]
    if not isinstance(experts, int) or experts < 1:
        raise ValueError(f"moe['num_experts'] must be a positive int (e.g. 8); got {experts!r}.")
    check_divisible("moe['num_experts']", experts, axis="expert")  # split over the axis
    if not isinstance(k, int) or not 1 <= k <= experts:
        raise ValueError(f"moe['experts_per_token']={k!r} must be an int in [1, num_experts="
                         f"{experts}]: a token cannot choose more experts than exist. Lower "
                         f"experts_per_token or raise num_experts.")
    if moe["activation"] not in EXPERT_ACTIVATIONS:
        raise ValueError(f"moe['activation']={moe['activation']!r} is unknown; use one of "
                         f"{EXPERT_ACTIVATIONS} ('swiglu': Mixtral's gated experts; 'gelu': "
                         f"a GPT MLP's, two matrices).")
    if moe["router"] not in ROUTERS:
        raise ValueError(f"moe['router']={moe['router']!r} is unknown; use one of {ROUTERS}.")
    if not isinstance(moe["renormalize"], bool):
        raise ValueError(f"moe['renormalize'] must be True (the k weights divided by their "
                         f"sum: Mixtral) or False (as routed: Qwen3-MoE's norm_topk_prob: "
                         f"false); got {moe['renormalize']!r}.")
    if not isinstance(moe["every"], int) or not 1 <= moe["every"] <= num_layers:
        raise ValueError(f"moe['every']={moe['every']!r} must be an int in [1, num_layers="
                         f"{num_layers}] (1: every block; 2: every second block...).")
    if scan_layers is None:  # the backbone's default: stacked under a pipeline
        scan_layers = stacking_default()
    if scan_layers and moe["every"] != 1:  # one block stacked L times: all alike
        raise ValueError(f"moe['every']={moe['every']} mixes dense and MoE blocks, which a "
                         f"scanned stack (scan_layers=True) cannot hold: it stacks one block "
                         f"L times. Use every=1 with scan_layers, or scan_layers=False.")
    factor = moe["capacity_factor"]
    if factor is not None and not factor > 0:
        raise ValueError(f"moe['capacity_factor'] must be None (dropless) or > 0; got "
                         f"{factor!r}.")
    scale = moe["routed_scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"moe['routed_scale'] must be a number > 0 (1: the routed experts' "
                         f"output as weighted; DeepSeek-V3 used 2.5); got {scale!r}.")
    rate = moe["balance_bias_rate"]
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate >= 0:
        raise ValueError(f"moe['balance_bias_rate'] must be a number >= 0 (0: off; DeepSeek-V3 "
                         f"used 0.001); got {rate!r}.")
    return moe


def block_moe(moe: dict | None, index: int) -> dict | None:
    """The MoE layer's arguments for block ``index`` (0-based), or None for a dense block:
    with ``every=k``, blocks ``k-1, 2k-1, ...`` are MoE (Switch's "every other layer").

    Example:
        >>> [block_moe(check_moe({"num_experts": 4, "every": 2}, 4, 8), i) is None
        ...  for i in range(4)]
        [True, False, True, False]
    """
    if moe is None or (index + 1) % moe["every"]:
        return None
    return {key: value for key, value in moe.items() if key != "every"}


def _batch_sum():
    """A sum over the devices that split the batch's rows (and tokens) in the region being
    traced — kdist's per-device loss (``gradient_reduction``) and a pipeline's stages, where
    each device holds its own rows (of the batch, of a microbatch) — or None where arrays
    are the batch's (XLA's partitioner) or a DiLoCo group's (each group routes its own
    rows; groups exchange nothing per step)."""
    here = region.current()
    axes = tuple(a for a in batch_axes(None, among=here.manual) if a != "replica") + (
        ("seq",) if here.tokens_split else ())

    def total(x):  # over the axes x differs along (a size-1 manual axis: none)
        over = tuple(a for a in axes if a in region.varying_axes(x))
        return jax.lax.psum(x, over) if over else x
    return total if axes else None


@keras.saving.register_keras_serializable(package="kdist")
class MoEFeedForward(layers.Layer):
    """Routed experts (optionally plus always-on shared experts) in place of a block's
    MLP: SwiGLU (Mixtral, Qwen, DeepSeek) or GELU (Switch Transformer; a GPT MLP's form).

    Args:
        num_experts: E routed experts.
        experts_per_token: k experts each token goes to.
        expert_dim: F, each expert's width.
        router: ``"softmax"`` (Mixtral) or ``"sigmoid"`` (DeepSeek-V3), :mod:`router`.
        shared_experts: experts every token goes through (DeepSeek, Qwen2-MoE): one MLP
            of width ``shared_experts x expert_dim`` (weights ``shared_gate`` (SwiGLU),
            ``shared_up`` ``(D, S)``, ``shared_down`` ``(S, D)``).
        capacity_factor: None (dropless) or the capacity path's factor (module docstring).
        aux_loss_weight: coefficient of the load-balance loss added in training.
        z_loss_weight: coefficient of the router z-loss added in training.
        balance_bias_rate: > 0: DeepSeek-V3's auxiliary-loss-free balance bias, moved by
            this much per training step (module docstring; non-trainable weight
            ``balance_bias`` ``(E,)``, float32, replicated). 0 (default): no bias.
        renormalize: the k chosen experts' weights divided by their sum (default, Mixtral),
            or (False) the router's probabilities as they are (Qwen3-MoE's
            ``norm_topk_prob: false``).
        routed_scale: the routed experts' weighted sum multiplied by this (DeepSeek-V2/V3's
            ``routed_scaling_factor``; shared experts are not scaled). Renormalised top-k
            weights sum to 1, so the k experts' output is their weighted mean: 1/k of a
            dense MLP of the same active width at uniform weights. Default 1.
        activation: ``"swiglu"`` (default; weights ``gate``, ``up``, ``down``) or
            ``"gelu"`` (``down(gelu(x up))``, GPT-2's tanh form, no biases: the experts of
            a GPT block's MLP, two matrices each; :func:`kdist.parallel.experts.expert_mlp`).
        matmul_precision: ``"bf16"`` (default), ``"int8"`` or ``"fp8"``: the experts' (and
            shared experts') matmuls quantized forward and backward, each expert
            scaled per token and per output channel (:mod:`kdist.precision`); the router
            stays float32.
        initializer_range, output_initializer_range: as :class:`MLP`'s.

    Weights: ``router (D, E)``; ``gate`` (SwiGLU), ``up`` ``(E, D, F)`` and ``down``
    ``(E, F, D)`` with the logical axis ``expert`` first (sharded over the ``expert`` mesh
    axis); :attr:`kernels` lists them in :func:`~kdist.parallel.experts.expert_mlp`'s order.

    Example:
        >>> layer = MoEFeedForward(num_experts=4, experts_per_token=1, expert_dim=8,
        ...                        router="sigmoid", shared_experts=1)
        >>> y = layer(keras.ops.ones((1, 3, 16)), training=True)
        >>> len(layer.losses), tuple(layer.gate.shape)
        (2, (4, 16, 8))
    """

    def __init__(self, num_experts: int, experts_per_token: int = 2, expert_dim: int = 256,
                 router: str = "softmax", shared_experts: int = 0,
                 capacity_factor: float | None = None, aux_loss_weight: float = 0.01,
                 z_loss_weight: float = 0.001, initializer_range: float = 0.02,
                 output_initializer_range: float | None = None,
                 balance_bias_rate: float = 0.0, renormalize: bool = True,
                 matmul_precision: str = "bf16", routed_scale: float = 1.0,
                 activation: str = "swiglu", **kwargs):
        super().__init__(**kwargs)
        self.matmul_precision = check_precision(matmul_precision)
        check_moe(dict(num_experts=num_experts, experts_per_token=experts_per_token,
                       router=router, capacity_factor=capacity_factor,
                       balance_bias_rate=balance_bias_rate, renormalize=renormalize,
                       routed_scale=routed_scale, activation=activation), 1, expert_dim)
        self.activation = activation
        self.renormalize = renormalize
        self.routed_scale = routed_scale
        self.num_experts = num_experts
        self.experts_per_token = experts_per_token
        self.expert_dim = expert_dim
        self.router = router
        self.shared_experts = shared_experts
        self.capacity_factor = capacity_factor
        self.aux_loss_weight = aux_loss_weight
        self.z_loss_weight = z_loss_weight
        self.initializer_range = initializer_range
        self.output_initializer_range = output_initializer_range
        self.balance_bias_rate = balance_bias_rate

    def build(self, input_shape):
        d, e, f = input_shape[-1], self.num_experts, self.expert_dim
        normal = keras.initializers.RandomNormal
        std, out_std = self.initializer_range, (self.output_initializer_range
                                                or self.initializer_range)
        self.router_kernel = add_weight(self, "router", (d, e), ("embed", None),
                                        initializer=normal(stddev=std))
        gated = self.activation == "swiglu"
        self.gate = add_weight(self, "gate", (e, d, f), ("expert", "embed", "mlp"),
                               initializer=normal(stddev=std)) if gated else None
        self.up = add_weight(self, "up", (e, d, f), ("expert", "embed", "mlp"),
                             initializer=normal(stddev=std))
        self.down = add_weight(self, "down", (e, f, d), ("expert", "mlp", "embed"),
                               initializer=normal(stddev=out_std))
        self.shared = None  # DeepSeek's shared experts: one MLP of their summed width
        if self.shared_experts:
            s = self.shared_experts * f
            self.shared = [add_weight(self, name, shape, axes, initializer=normal(stddev=sd))
                           for name, shape, axes, sd in (
                               ("shared_gate", (d, s), ("embed", "mlp"), std),
                               ("shared_up", (d, s), ("embed", "mlp"), std),
                               ("shared_down", (s, d), ("mlp", "embed"), out_std))
                           if gated or name != "shared_gate"]
        # Statistics of the last batch, for logs (not trained, not part of the function).
        self.load = add_weight(self, "expert_load", (e,), ("expert",), initializer="zeros",
                               trainable=False, dtype="float32")
        self.dropped = add_weight(self, "dropped_tokens", (), (), initializer="zeros",
                                  trainable=False, dtype="float32")
        # DeepSeek-V3's balance bias: part of the routing (saved, restored), not trained.
        # Replicated: every device chooses with the same bias, updated from the global
        # load. Only when on, so that a model without it keeps its variables unchanged.
        self.balance_bias = add_weight(self, "balance_bias", (e,), (None,), initializer="zeros",
                                       trainable=False, dtype="float32"
                                       ) if self.balance_bias_rate else None

    @property
    def kernels(self) -> list:
        """``[gate, up, down]`` (SwiGLU) or ``[up, down]`` (GELU): ``expert_mlp``'s order."""
        return [w for w in (self.gate, self.up, self.down) if w is not None]

    def forward(self, x):
        """``(..., D) -> ((..., D), MoEStats)``, pure: nothing recorded (see module)."""
        shape = ops.shape(x)
        tokens = ops.reshape(x, (-1, shape[-1]))  # (N, D)
        kernels = [ops.cast(w, x.dtype) for w in self.kernels]
        logits = ops.matmul(ops.cast(tokens, "float32"),
                            ops.cast(self.router_kernel, "float32"))  # (N, E) float32
        bias = None if self.balance_bias is None else ops.cast(self.balance_bias, "float32")
        weights, experts, probs = route(logits, self.experts_per_token, self.router, bias,
                                        self.renormalize)
        counts = expert_counts(experts, self.num_experts)  # (E,)
        # over the 'expert' mesh axis (kdist.parallel.experts), in the activations' layout
        parallel = experts_module.dispatch(
            x, ops.reshape(experts, (*shape[:-1], self.experts_per_token)),
            self._region_weights(kernels), self.capacity_factor, self.matmul_precision)
        if parallel is not None:
            out, dropped = parallel[0].reshape(experts.shape + (shape[-1],)), parallel[1]
        elif self.capacity_factor is None or not isinstance(tokens.shape[0], int):
            # (Keras' symbolic shape inference: no capacity of an unknown batch; same shape)
            out, dropped = (dropless(tokens, experts, counts, kernels, self.matmul_precision),
                            jnp.zeros((), "int32"))
        else:
            out, dropped = capacity_limited(tokens, experts, counts, kernels,
                                            self.capacity_factor, self.matmul_precision)
        y = jnp.einsum("nkd,nk->nd", out, (weights * self.routed_scale).astype(out.dtype))
        y = ops.reshape(y, shape)
        if self.shared is not None:  # (..., D) -> (..., S) -> (..., D), every token
            y = y + expert_mlp(x, [ops.cast(w, x.dtype) for w in self.shared], self._matmul)
        # In kdist's per-device loss (gradient_reduction) this device holds its rows only:
        # the batch's counts and sums, so that losses, load and bias are the batch's.
        sums = _batch_sum()  # None where the arrays here are the batch's
        batch = sums or (lambda v: v)
        counts = batch(counts)  # (E,)
        assignments = jnp.sum(counts)  # A = N k
        # The bias's direction from integer counts (mean count = A / E, compared as
        # A vs E x count): exact, so every device and every run moves it alike.
        balance = None if bias is None else jnp.sign(
            assignments - self.num_experts * counts).astype("float32")  # (E,)
        stats = MoEStats(load_balance_loss(probs, counts, sums), z_loss(logits, sums),
                         counts.astype("float32") / assignments.astype("float32"),
                         batch(dropped).astype("float32"), balance, counts.astype("float32"))
        return y, stats

    def _region_weights(self, kernels):
        """The expert weights as they enter the experts' region: in the compute dtype, or
        on a CPU as stored (float32; the region casts them): the transpose of the region's
        entry sums their gradient over the batch's axes, and XLA:CPU aborts promoting a
        bfloat16 all-reduce whose reducer JAX annotated with a sharding (JAX 0.10,
        AllReducePromotion: "Invalid binary instruction opcode copy")."""
        if jax.default_backend() != "cpu":
            return kernels
        with _keras_compat.no_autocast():
            return [ops.convert_to_tensor(w) for w in self.kernels]

    def _matmul(self, x, w):
        if self.matmul_precision == "bf16":
            return ops.matmul(x, w)
        return quantized.matmul(x, w, 1, self.matmul_precision)

    def record(self, stats: MoEStats, training=None) -> None:
        """The weighted losses added to the model's loss and the load statistics kept — in
        training only: validation loss stays the language-model loss, and the statistics
        are the last training batch's whatever was evaluated since."""
        if not training:
            return
        if self.aux_loss_weight:
            self.add_loss(self.aux_loss_weight * stats.aux_loss)
        if self.z_loss_weight:
            self.add_loss(self.z_loss_weight * stats.z_loss)
        if in_microbatches():  # sums the step adds up (combine_microbatches); bias kept
            self.load.assign(stats.counts)
            self.dropped.assign(stats.dropped)
            return
        self.load.assign(stats.load)
        self.dropped.assign(stats.dropped)
        if self.balance_bias is not None:  # overloaded experts down, underloaded up
            self.balance_bias.assign(self.balance_bias + self.balance_bias_rate * stats.balance)

    def combine_microbatches(self, old: dict, summed: dict) -> dict:
        """The state after a step whose microbatches each ran :meth:`record` under
        :func:`kdist.models.scan.in_microbatches` (a pipeline's): ``old`` and ``summed`` map
        the names of this layer's non-trainable variables to their values before the step
        and to the sum of the microbatches' (``(L, ...)`` in a stack: a leading layer
        axis). The load is the batch's assignments per expert over their total, the
        dropped count the sum, and the bias moves once, by the batch's counts — what one
        call on the whole batch records (the same integer counts, the same float32
        operations).

        Example:
            >>> layer = MoEFeedForward(num_experts=2, experts_per_token=1, expert_dim=4,
            ...                        balance_bias_rate=0.5)
            >>> layer.build((1, 4, 8))
            >>> new = layer.combine_microbatches(
            ...     {"balance_bias": jnp.zeros(2)},
            ...     {"expert_load": jnp.array([3.0, 1.0]), "dropped_tokens": jnp.array(0.0)})
            >>> new["expert_load"].tolist(), new["balance_bias"].tolist()
            ([0.75, 0.25], [-0.5, 0.5])
        """
        counts = summed["expert_load"]  # (..., E) assignments, integers in float32
        assignments = jnp.sum(counts, axis=-1, keepdims=True)
        new = {"expert_load": counts / assignments, "dropped_tokens": summed["dropped_tokens"]}
        if self.balance_bias is not None:
            new["balance_bias"] = old["balance_bias"] + self.balance_bias_rate * jnp.sign(
                assignments - self.num_experts * counts)
        return new

    def call(self, x, training=None):
        y, stats = self.forward(x)
        self.record(stats, training)
        return y

    def get_config(self):
        return {**super().get_config(), "num_experts": self.num_experts,
                "experts_per_token": self.experts_per_token, "expert_dim": self.expert_dim,
                "router": self.router, "shared_experts": self.shared_experts,
                "capacity_factor": self.capacity_factor,
                "aux_loss_weight": self.aux_loss_weight, "z_loss_weight": self.z_loss_weight,
                "initializer_range": self.initializer_range,
                "output_initializer_range": self.output_initializer_range,
                "balance_bias_rate": self.balance_bias_rate, "renormalize": self.renormalize,
                "matmul_precision": self.matmul_precision, "routed_scale": self.routed_scale,
                "activation": self.activation}

