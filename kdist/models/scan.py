"""Scanned layer stacks: one block definition, its weights stacked on a leading layer axis,
the forward pass one ``lax.scan`` (``GPTBackbone(scan_layers=True)``, ``BertBackbone``).

:class:`LayerStack` holds ``num_layers`` copies of a block as a single set of weights of
shape ``(L, ...)``, each with the logical axis ``"layers"`` first (mapped to the ``stage``
mesh axis, so a pipeline's stages each hold their own contiguous layers); under a pipeline
with ``R`` circular repeats the shape is ``(R, L / R, ...)`` — the same layers in the same
order, viewed so that one plain sharding of the second dimension over ``stage`` gives every
device its non-adjacent layers (:mod:`kdist.parallel.pipeline`). Weight paths mirror the
unstacked ones, ``blocks/attention/query/kernel`` for ``block_<i>/attention/query/kernel``
(:mod:`kdist.models.stacking` converts between the two, exactly).

The block is built once as a *template* with no memory of its own (its variables are never
initialised) and applied to each layer's slice with ``stateless_call``, so the compiled
program holds one copy of the block's computation instead of L: XLA compiles it once.
The block's own options work inside the scan body: remat policies wrap its forward pass,
and dropout draws a fresh mask per layer and step (each layer's seed is the stack's seed
generator folded with the layer index).

A block's non-trainable state (a MoE layer's load statistics and balance bias) is stacked
too; each layer reads and updates its row. In a pipeline each microbatch's layers run
under :func:`in_microbatches`: they record what adds up over microbatches (a MoE layer's
counts), the stack sums it, and each stateful layer of the block turns the sums into its
state once per step (``combine_microbatches``), as one call on the whole batch would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading

import jax
import jax.numpy as jnp
import keras
import numpy as np  # noqa: F401 (used by the docstring examples)
from keras import layers, ops

from kdist import _keras_compat
from kdist.models import remat, stacking
from kdist.parallel import experts, pipeline, rules
from kdist.parallel.constraints import shard_batch

# Initializers that draw every element independently of the shape: one call with the
# stacked shape gives independent layers.
_ELEMENTWISE = (keras.initializers.RandomNormal, keras.initializers.TruncatedNormal,
                keras.initializers.RandomUniform, keras.initializers.Zeros,
                keras.initializers.Ones, keras.initializers.Constant)


class StackedInitializer(keras.initializers.Initializer):
    """Initialises a stacked weight as ``prod(lead)`` independent layers of ``initializer``.

    An element-wise initializer (normal, uniform, constants) is called once with the whole
    shape; one whose values depend on the shape (Glorot, He, orthogonal: fan-in and
    fan-out) is called per layer on the layer's shape, each with its own seed.

    Example:
        >>> init = StackedInitializer(keras.initializers.GlorotUniform(seed=1), (3,))
        >>> init((3, 4, 5)).shape
        (3, 4, 5)
    """

    def __init__(self, initializer, lead: tuple[int, ...]):
        self.initializer = keras.initializers.get(initializer)
        self.lead = tuple(lead)

    def __call__(self, shape, dtype=None):
        if isinstance(self.initializer, _ELEMENTWISE):
            return self.initializer(shape, dtype=dtype)
        per_layer = tuple(shape[len(self.lead):])
        config = self.initializer.get_config()
        layers_ = []
        for i in range(math.prod(self.lead)):
            if "seed" in config:
                seed = config["seed"]
                init = type(self.initializer).from_config(
                    {**config, "seed": None if seed is None else int(seed) + i})
            else:
                init = self.initializer
            layers_.append(init(per_layer, dtype=dtype))
        return ops.reshape(ops.stack(layers_), shape)

    def get_config(self):
        return {"initializer": keras.initializers.serialize(self.initializer),
                "lead": list(self.lead)}


@keras.saving.register_keras_serializable(package="kdist")
class StackedWeights(layers.Layer):
    """The stacked weights of one sublayer of the block (e.g. ``attention/query``): a
    holder that is never called, so the stack's weight paths mirror the block's.

    A ``.keras`` file loads into another leading shape of the same layers (``(L, ...)`` <->
    ``(R, L / R, ...)``, another pipeline's repeats) by a reshape, which keeps the order.
    """

    def call(self, *args, **kwargs):
        raise TypeError("StackedWeights only holds a LayerStack's weights; call the stack.")

    def load_own_variables(self, store):
        if len(store.keys()) != len(self.weights):
            raise ValueError(f"Layer '{self.name}' expects {len(self.weights)} variables, but "
                             f"the file holds {len(store.keys())}.")
        for i, variable in enumerate(self.weights):
            value = stacking.reviewed(store[str(i)], variable.shape)
            if tuple(value.shape) != tuple(variable.shape):
                raise ValueError(f"'{variable.path}' has shape {tuple(variable.shape)}; the file "
                                 f"holds {tuple(value.shape)}.")
            variable.assign(value)


_microbatches = threading.local()


def in_microbatches() -> bool:
    """Whether the layers being traced run one microbatch of a pipeline's step: a layer with
    state then records sums over the step's microbatches (see the module docstring).

    Example:
        >>> in_microbatches()
        False
    """
    return getattr(_microbatches, "on", False)


@contextlib.contextmanager
def _microbatched():
    before, _microbatches.on = in_microbatches(), True
    try:
        yield
    finally:
        _microbatches.on = before


@dataclasses.dataclass
class _Untracked:
    """What the stack keeps out of Keras' tracking (a layer or variables assigned to a layer
    attribute would become its own weights): the template block and the stacked variables
    in the order of the block's trainable variables."""

    block: layers.Layer
    stacked: list = dataclasses.field(default_factory=list)
    # The block's non-trainable state besides dropout seeds (a MoE layer's load statistics
    # and balance bias), stacked as the weights are; and for each of the block's
    # non-trainable variables, in its order, ("seed", d) or ("state", index into state).
    state: list = dataclasses.field(default_factory=list)
    order: list = dataclasses.field(default_factory=list)
    state_of: dict = dataclasses.field(default_factory=dict)  # id(block var) -> stacked


@keras.saving.register_keras_serializable(package="kdist")
class LayerStack(layers.Layer):
    """``num_layers`` copies of ``block`` with stacked weights, run as one scan (or, under a
    ``stage`` mesh axis, as a pipeline: :mod:`kdist.parallel.pipeline`).

    ``call(x, **kwargs)`` applies layer 0, 1, ... L-1 to ``x`` ``(B, T, D)``; ``kwargs``
    (``attention_mask``, ``positions``, ``segment_ids``) go to every layer. Weights are made by
    ``build`` with the stacked shape ``lead + block_weight_shape``; ``lead`` is ``(L,)``,
    or ``(R, L / R)`` when the distribution asks for ``R`` circular pipeline repeats.

    Args:
        block: the block layer (unbuilt; its config is this stack's config), e.g. a
            ``PreNormBlock``. Its non-trainable state is stacked like its weights (a MoE
            layer's load statistics and balance bias; dropout seeds are drawn per layer).
        num_layers: L.

    Example:
        >>> from kdist.models.layers import PreNormBlock
        >>> stack = LayerStack(PreNormBlock(num_heads=2, head_dim=8, intermediate_dim=32),
        ...                    num_layers=3)
        >>> stack(keras.ops.ones((2, 4, 16))).shape
        (2, 4, 16)
        >>> [tuple(w.shape) for w in stack.weights][:1]
        [(3, 16)]
    """

    def __init__(self, block, num_layers: int, **kwargs):
        # Variables are read unconverted (float32 under mixed precision) and passed to the
        # block, which casts them as an unstacked block would.
        kwargs["autocast"] = False
        super().__init__(**kwargs)
        if isinstance(block, dict):
            block = keras.saving.deserialize_keras_object(block)
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int; got {num_layers!r}.")
        seeds = [v for v in block.non_trainable_variables
                 if not v.path.endswith("seed_generator_state")]
        if seeds:
            raise ValueError(f"LayerStack cannot stack a block with non-trainable state other "
                             f"than dropout seeds ({[v.path for v in seeds]}).")
        self.num_layers = num_layers
        self.lead = pipeline.stack_shape(num_layers)  # (L,) or (R, L/R); checks the mesh
        self._parts = _Untracked(block)
        self.seed_count = len(block.non_trainable_variables)
        self.seed_generator = keras.random.SeedGenerator(name="layer_seeds") \
            if self.seed_count else None

    @property
    def block(self) -> layers.Layer:
        """The template block (its variables hold no values: use the stack's weights)."""
        return self._parts.block

    def build(self, input_shape):
        block = self.block
        with keras.StatelessScope(initialize_variables=False):  # no memory for the template
            block.build(input_shape)
        _keras_compat.forget_uninitialized(block.weights)
        lead_axes = ("layers",) if len(self.lead) == 1 else (None, "layers")
        groups: dict[str, StackedWeights] = {}
        seeds = 0
        for v in block.non_trainable_variables:  # seeds numbered as before: d = 0, 1, ...
            if v.path.endswith("seed_generator_state"):
                self._parts.order.append(("seed", seeds))
                seeds += 1
            else:
                self._parts.order.append(("state", sum(k == "state" for k, _ in
                                                       self._parts.order)))
        state = [v for v in block.non_trainable_variables
                 if not v.path.endswith("seed_generator_state")]
        for v in [*block.trainable_variables, *state]:
            relative = v.path.split(f"{block.name}/", 1)[-1]  # attention/query/kernel
            group, _, name = relative.rpartition("/")
            axes = rules.declared_axes(v)
            if axes is None:
                raise ValueError(f"Block weight '{relative}' declares no logical axes; "
                                 f"LayerStack needs them to lay out its stack.")
            if group not in groups:
                groups[group] = StackedWeights(name=group.rpartition("/")[-1] or "weights",
                                               dtype=self.dtype_policy)
            scopes = [keras.name_scope(p) for p in group.split("/")[:-1] if p]
            for scope in scopes:
                scope.__enter__()
            try:
                stacked = rules.add_weight(
                    groups[group], name, self.lead + tuple(v.shape), lead_axes + tuple(axes),
                    initializer=StackedInitializer(_keras_compat.variable_initializer(v),
                                                   self.lead),
                    dtype=v.dtype, trainable=v.trainable)
            finally:
                for scope in reversed(scopes):
                    scope.__exit__(None, None, None)
            (self._parts.stacked if v.trainable else self._parts.state).append(stacked)
            self._parts.state_of[id(v)] = stacked
        for holder in groups.values():
            holder.built = True
        self.weight_groups = list(groups.values())

    # === Forward ===

    def stacked_state_of(self, variable):
        """The stacked ``(L, ...)`` variable holding the template block's non-trainable
        ``variable`` (e.g. a MoE layer's ``expert_load``) for every layer."""
        return self._parts.state_of[id(variable)]

    def _layer(self, weights, x, kwargs, index, seed, training, state=()):
        """Layer ``index`` (a traced int) with its weight slices: ``(B, T, D) -> (B, T, D)``;
        with its ``state`` slices (see :meth:`_scan_with_state`), also the state after it
        and the sum of the losses it added."""
        # A block with dropout has a seed (the stack's generator): each layer and each of
        # its dropouts its own mask.
        key = None if seed is None else jax.random.fold_in(seed, index)
        values = [state[i] if kind == "state" else jax.random.fold_in(key, i)
                  for kind, i in self._parts.order]
        weights = [experts.as_whole(w, v.shape)  # (a pipeline stage's experts: padded)
                   for w, v in zip(weights, self.block.trainable_variables)]
        y, values, losses = self.block.stateless_call(
            weights, values, x, training=training, return_losses=True, **kwargs)
        if not self._parts.state:
            return y
        state = [v for (kind, _), v in zip(self._parts.order, values) if kind == "state"]
        return y, state, sum(losses, jnp.zeros((), "float32"))

    def _scan_with_state(self, layer, weights, x, kwargs, seed, training):
        """The scan of a block with non-trainable state (a MoE block: its load statistics,
        its balance bias): each layer reads and updates its slice of the stacked state, and
        the losses it adds (load balance, router z-loss) leave the scan as outputs — a
        Keras loss added inside the scan's body would be its tracer — and are added here."""
        state = [ops.convert_to_tensor(v) for v in self._parts.state]  # (L, ...) each

        def body(h, xs):
            w, s, index = xs
            h, s, loss = layer(w, h, kwargs, index, seed, s)
            return h, (s, loss)

        x, (state, losses) = jax.lax.scan(body, x, (list(weights), state,
                                                   jnp.arange(self.num_layers)))
        if training:
            for variable, value in zip(self._parts.state, state):
                variable.assign(value)
            self.add_loss(jnp.sum(losses))
        return x

    def _prepare(self, x, attention_mask, positions, segment_ids, training):
        """What both forward paths need: the weights, the step's dropout seed, the layers'
        keyword arguments, the layer function and the pipeline schedule (or None)."""
        weights = self._stacked_values()  # lead + shape, as stored
        seed = None
        if self.seed_generator is not None:  # the stream advances only where dropout runs,
            # as Keras' own Dropout's does (an evaluation between steps must not change the
            # masks the steps draw); inference reads the state, for blocks that need a key
            seed = self.seed_generator.next() if training else \
                ops.convert_to_tensor(self.seed_generator.state)
        kwargs = {k: v for k, v in (("attention_mask", attention_mask),
                                    ("positions", positions),
                                    ("segment_ids", segment_ids)) if v is not None}

        schedule = pipeline.schedule_for(x.shape[0], self.num_layers, training=training)

        def layer(w, h, kw, index, seed, state=()):
            if schedule is None or not self._parts.state:
                return self._layer(w, h, kw, index, seed, training, state)
            with _microbatched():  # one microbatch: its sums (module docstring)
                return self._layer(w, h, kw, index, seed, training, state)

        if schedule is not None and len(self.lead) != (1 if schedule.repeats == 1 else 2):
            raise ValueError(
                f"{self.name} was built with its layers stacked as {self.lead}, for another "
                f"pipeline_repeats than the distribution's {schedule.repeats}. Build the model "
                f"after setting the distribution (or load it under it: kdist.models.stacking "
                f"converts the weights).")
        return weights, seed, kwargs, layer, schedule

    def scheduled_loss(self, x, loss_fn, loss_weights, targets, attention_mask=None,
                       positions=None, segment_ids=None):
        """The training loss of ``x`` through the stack and ``loss_fn`` under a
        ``pipeline_schedule`` that needs the loss inside it (1F1B, interleaved:
        :func:`kdist.parallel.pipeline.stack.scheduled`); ``loss_fn(loss_weights, y, targets_m)``
        is one microbatch's share on one device's rows. Called in the model's training
        forward pass, inside Keras' stateless scope."""
        weights, seed, kwargs, layer, schedule = self._prepare(
            x, attention_mask, positions, segment_ids, True)
        layouts = [pipeline.layout_axes(v) for v in self._parts.stacked]
        if not self._parts.state:
            return pipeline.scheduled(layer, weights, x, kwargs, seed, schedule, loss_fn,
                                      loss_weights, targets, layouts)
        loss, sums = pipeline.scheduled(layer, weights, x, kwargs, seed, schedule, loss_fn,
                                        loss_weights, targets, layouts, self._flat_state())
        self._combine_microbatches(sums)  # (the layers' losses are in `loss`)
        return loss

    def call(self, x, attention_mask=None, positions=None, segment_ids=None, training=None):
        weights, seed, kwargs, layer, schedule = self._prepare(
            x, attention_mask, positions, segment_ids, training)
        if schedule is not None:
            layouts = [pipeline.layout_axes(v) for v in self._parts.stacked]
            if self._parts.state:
                x, loss, sums = pipeline.pipelined(layer, weights, x, kwargs, seed, schedule,
                                                   layouts, self._flat_state())
                if training:
                    self.add_loss(loss)
                    self._combine_microbatches(sums)
            else:
                x = pipeline.pipelined(layer, weights, x, kwargs, seed, schedule, layouts)
        else:  # a scan keeps what its blocks' policy says, never every intermediate
            with remat.stacked():  # (kdist.models.remat.in_scan; a pipeline's own stays)
                if self._parts.state:
                    x = self._scan_with_state(layer, self._flat(weights), x, kwargs, seed,
                                              training)
                else:
                    x = scan_layers(layer, self._flat(weights), x, kwargs, seed)
        return shard_batch(x)  # (B, T, D), B split over the replica axes

    def _stacked_values(self):
        """The stacked weights as stored (float32 under mixed precision): each layer's block
        casts its own slice, as an unstacked block casts its weights. ``autocast=False``
        alone does not ensure it: Keras opens an autocast scope of the compute dtype for a
        layer called with none open (a backbone run by ``stateless_call``), and the whole
        stack cast before the loop is a second copy of the weights."""
        with _keras_compat.no_autocast():
            return [ops.convert_to_tensor(v) for v in self._parts.stacked]

    def _flat_state(self):
        """The stacked state as ``(L, ...)`` arrays, whatever the stack's lead."""
        return self._flat([ops.convert_to_tensor(v) for v in self._parts.state])

    def _combine_microbatches(self, sums):
        """The state after a pipeline's step from its microbatches' sums ``(L, ...)``: each
        stateful layer of the block combines its own (``combine_microbatches``), every
        layer of the stack at once."""
        block, old = self.block, self._flat_state()
        position = {id(v): i for i, v in enumerate(self._parts.state)}
        index = {id(v): position[id(stacked)] for v in block.non_trainable_variables
                 if id(stacked := self._parts.state_of.get(id(v))) in position}
        combined = set()
        for inner in _keras_compat.all_layers(block):
            own = [v for v in inner.non_trainable_variables if id(v) in index]
            if not own or not hasattr(inner, "combine_microbatches"):
                continue
            by_name = {v.name: v for v in own}
            new = inner.combine_microbatches({v.name: old[index[id(v)]] for v in own},
                                             {v.name: sums[index[id(v)]] for v in own})
            for name, value in new.items():
                stacked = self._parts.state_of[id(by_name[name])]
                stacked.assign(ops.reshape(value, stacked.shape))
            combined |= {id(v) for v in own}
        alone = [v.path for v in block.non_trainable_variables
                 if id(v) in index and id(v) not in combined]
        if alone:
            raise ValueError(f"{self.name}'s block has state {alone} that no layer of it "
                             f"combines over a pipeline's microbatches (combine_microbatches"
                             f"()). Train it without a 'stage' axis.")

    def _flat(self, weights):
        lead = len(self.lead)
        return [ops.reshape(w, (self.num_layers,) + tuple(w.shape[lead:])) for w in weights]

    def call_with_cache(self, x, cache, cache_index):
        """Cached decoding (``kdist.models.generation``): ``x`` ``(B, T, D)``, ``cache``
        ``(B, L, 2, S, K, H)``; returns ``(x, updated cache)``."""
        weights = self._flat(self._stacked_values())
        state = [ops.convert_to_tensor(v) for v in self._parts.state]  # (L, ...): routing's

        def body(h, xs):
            w, s, layer_cache = xs
            values = [s[i] if kind == "state" else jnp.zeros((2,), "uint32")  # no dropout
                      for kind, i in self._parts.order]
            (h, layer_cache), _ = self.block.stateless_call(
                list(w), values, h, cache=layer_cache, cache_index=cache_index)
            return h, layer_cache

        x, caches = jax.lax.scan(body, x, (weights, state, jnp.moveaxis(cache, 1, 0)))
        return x, jnp.moveaxis(caches, 0, 1)

    def compute_output_spec(self, x, attention_mask=None, positions=None, segment_ids=None,
                            training=None):
        return keras.KerasTensor(x.shape, self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "num_layers": self.num_layers,
                "block": keras.saving.serialize_keras_object(self.block)}


def stacking_default() -> bool:
    """What ``scan_layers=None`` means for a backbone built now: stacked when the active
    distribution has a ``stage`` (pipeline) axis, which needs stacked weights.

    Example:
        >>> stacking_default()  # no distribution
        False
    """
    return pipeline.stages() > 1


def scan_layers(layer, weights, x, kwargs, seed=None):
    """``x`` through L layers: ``layer(w, h, kwargs, i, seed)`` for the slices ``w`` of the
    ``(L, ...)`` ``weights``, as one ``lax.scan`` (the block is traced and compiled once).

    Example:
        >>> scan_layers(lambda w, h, kw, i, s: h * w[0], [jnp.full((3,), 2.0)], jnp.ones(()), {})
        Array(8., dtype=float32)
    """
    def body(h, xs):
        w, index = xs
        return layer(w, h, kwargs, index, seed), None

    count = weights[0].shape[0]
    x, _ = jax.lax.scan(body, x, (list(weights), jnp.arange(count)))
    return x
