"""What every kdist model family shares: ``Backbone``, ``Task`` and ``CostModel``.

* :class:`Backbone` — a functional Keras model whose constructor arguments are its config:
  ``get_config`` is Keras' own (name, trainable, dtype) plus every constructor argument,
  ``from_config`` its inverse, ``from_preset`` a shape from the family's ``presets`` table.
* :class:`Task` — a backbone with a head and a loss. It *declares* the training-step
  features it supports (``step_features``: ``"gradient_reduction"``, ``"fused_loss"``,
  ``"pipeline"``, read by :mod:`kdist.parallel.step`, which never asks for a class), routes
  ``compile`` and ``compute_loss_and_updates`` through that module, checks NumPy token ids
  before they reach the device, and gives the family's :class:`CostModel`.
* :class:`CostModel` (:mod:`kdist.models.cost`) — parameters, FLOPs per token and
  activation bytes per token of one family, for ``kdist.plan``, ``kdist.flops`` and the
  ``Throughput`` callback.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, ClassVar

import keras
import numpy as np
from keras import ops

from kdist import _keras_compat, accelerators
from kdist.data.checks import check_id_range, check_token_ids
from kdist.groups import diloco
from kdist.models import remat
from kdist.models.cost import CostModel
from kdist.models.presets import preset_config
from kdist.parallel import step


def constructor_arguments(cls) -> dict[str, inspect.Parameter]:
    """The named constructor arguments of ``cls`` (the config keys besides Keras' own)."""
    params = inspect.signature(cls.__init__).parameters
    return {name: p for name, p in params.items() if name != "self"
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _deserialized_dtype(config: dict) -> dict:
    config = dict(config)
    if isinstance(config.get("dtype"), dict):
        config["dtype"] = keras.saving.deserialize_keras_object(config["dtype"])
    return config


class Backbone:
    """Base of kdist backbones: constructor arguments are the config.

    A mixin before ``keras.Model``: ``class MyBackbone(Backbone, keras.Model)``. Not a
    ``keras.Model`` subclass itself because Keras rewrites the bases of a functional
    model's classes up to ``keras.Model`` into ``Functional`` (``Model.__init__`` ->
    ``inject_functional_model_class``): a shared ``keras.Model`` base would become
    ``Functional`` for every family, subclassed ones included, once one functional
    backbone is built.

    Subclasses set ``presets`` (name -> constructor arguments) and keep each constructor
    argument as an attribute of the same name (or name the attribute in
    ``config_attributes`` when the name is taken, e.g. by a layer).

    Example:
        >>> from kdist.models import GPTBackbone
        >>> b = GPTBackbone.from_preset("gpt-nano", vocabulary_size=64, num_layers=1)
        >>> GPTBackbone.from_config(b.get_config()).get_config() == b.get_config()
        True
    """

    presets: ClassVar[dict[str, dict]] = {}
    config_attributes: ClassVar[dict[str, str]] = {}  # argument -> attribute holding it
    hf_model_types: ClassVar[tuple[str, ...]] = ()  # Hugging Face model_types it loads

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()  # name, trainable, dtype
        for name in constructor_arguments(type(self)):
            config[name] = getattr(self, self.config_attributes.get(name, name))
        return config

    @classmethod
    def from_config(cls, config):
        return cls(**_deserialized_dtype(config))

    @classmethod
    def from_preset(cls, preset: str, **overrides):
        """A randomly initialised backbone of a preset's shape; ``overrides`` replace fields.

        Example:
            >>> from kdist.models import GPTBackbone
            >>> GPTBackbone.from_preset("gpt-nano", vocabulary_size=512).num_layers
            4
        """
        return cls(**preset_config(cls.presets, preset, **overrides))

    @classmethod
    def from_pretrained(cls, directory, **overrides):
        """The backbone with the weights of a local Hugging Face model directory, sharded
        under the active distribution as it is read (:mod:`kdist.models.hf`); ``overrides``
        replace config fields that change no shape (``dropout``, ``remat``...)."""
        from kdist.models import hf

        return hf.load_pretrained(cls, directory, **overrides)

    def save_pretrained(self, directory, tokenizer=None, **kwargs):
        """Writes the weights and config as a Hugging Face checkpoint
        (:func:`kdist.models.hf.export`)."""
        from kdist.models import hf

        return hf.export(self, directory, tokenizer=tokenizer, **kwargs)

    @classmethod
    def full_config(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """``config`` with the constructor's defaults for the arguments it leaves out.

        Example:
            >>> from kdist.models import GPTBackbone
            >>> GPTBackbone.full_config({"hidden_dim": 8})["norm"]
            'layer_norm'
        """
        defaults = {name: p.default for name, p in constructor_arguments(cls).items()
                    if p.default is not inspect.Parameter.empty}
        return {**defaults, **config}


class Task:
    """Base of kdist task models: a backbone, a head, a loss, the step routing.

    A mixin before ``keras.Model`` (``class MyTask(Task, keras.Model)``), for the reason
    given in :class:`Backbone`.

    Class attributes a task sets:
        backbone_class: its backbone's class (``from_preset``, ``cost_model_for``).
        step_features: the step features it supports (see :mod:`kdist.parallel.step`).
        token_id_inputs: keys of ``x`` holding token ids (for a bare array ``x``: the
            first key, i.e. ``x`` itself holds token ids).
        token_id_labels: whether ``y`` holds token ids (a language model's labels).

    NumPy (array-like) ``x`` and ``y`` given to ``fit``, ``evaluate`` and ``predict`` are
    checked before they reach the device: an id outside ``[0, vocabulary_size)`` raises a
    ``ValueError`` (else it gives NaN logits and a silent training loss of 0.0).

    Example:
        >>> from kdist.models import GPTCausalLM
        >>> lm = GPTCausalLM.from_preset("gpt-nano", vocabulary_size=64, num_layers=1)
        >>> sorted(lm.step_features)
        ['context_parallel', 'fused_loss', 'gradient_reduction', 'pipeline', 'token_reordering']
    """

    backbone_class: ClassVar[type[Backbone]] = Backbone
    step_features: ClassVar[frozenset[str]] = frozenset()
    token_id_inputs: ClassVar[tuple[str, ...]] = ("token_ids",)
    token_id_labels: ClassVar[bool] = False

    # === Training step ===

    def compile(self, optimizer="adamw", loss=None, **kwargs):
        step.check_compile(self)  # before any compilation
        super().compile(optimizer=diloco.wrap(optimizer), loss=loss, **kwargs)
        step.prepare(self)  # state the step features keep (residuals, replica groups)

    def train_step(self, state, data):
        with remat.choosing(accelerators.remat_for_data(self, data)):  # "auto" at this batch
            return step.train_step(self, super().train_step, state, data)

    def make_train_function(self, force=False):
        return step.make_train_function(self, super().make_train_function, force)

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables,
                                 metrics_variables, x, y, sample_weight, training=False,
                                 optimizer_variables=None):
        return step.compute_loss_and_updates(
            self, super().compute_loss_and_updates, trainable_variables,
            non_trainable_variables, metrics_variables, x, y, sample_weight,
            training=training, optimizer_variables=optimizer_variables)

    def compile_from_config(self, config):
        # Keras skips compiling on load when compile() is overridden; ours takes its config.
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)

    # === Token id checks ===

    def fit(self, x=None, y=None, *args, **kwargs):
        kwargs = step.fit_arguments(self, x, args, kwargs)  # by name, with the step's callbacks
        self.check_token_arrays(x, y, "fit")
        validation = kwargs.get("validation_data")
        if isinstance(validation, (tuple, list)) and validation:  # (x,), (x, y), (x, y, w)
            self.check_token_arrays(*[*validation, None][:2], "fit's validation_data")
        return super().fit(x, y, **self._with_id_check(kwargs))

    def evaluate(self, x=None, y=None, *args, **kwargs):
        self.check_token_arrays(x, y, "evaluate")
        return super().evaluate(x, y, *args, **self._with_id_check(kwargs))

    def predict(self, x, *args, **kwargs):
        self.check_token_arrays(x, None, "predict")
        return super().predict(x, *args, **self._with_id_check(kwargs))

    # One batch: the same host check (an id past the table would train on a 0.0 loss).
    def train_on_batch(self, x, y=None, *args, **kwargs):
        self.check_token_arrays(x, y, "train_on_batch")
        return super().train_on_batch(x, y, *args, **kwargs)

    def test_on_batch(self, x, y=None, *args, **kwargs):
        self.check_token_arrays(x, y, "test_on_batch")
        return super().test_on_batch(x, y, *args, **kwargs)

    def predict_on_batch(self, x):
        self.check_token_arrays(x, None, "predict_on_batch")
        return super().predict_on_batch(x)

    def check_token_arrays(self, x, y, where: str) -> None:
        """Raises ``ValueError`` if array-like token ids in ``x`` (or ``y``, for a language
        model) lie outside ``[0, vocabulary_size)``. Datasets and generators pass unchecked
        (see the task's in-graph ``check_token_ids`` option).

        Example:
            >>> from kdist.models import GPTCausalLM
            >>> lm = GPTCausalLM.from_preset("gpt-nano", vocabulary_size=64, num_layers=1)
            >>> lm.check_token_arrays(np.array([[1, 64]]), None, "predict")
            Traceback (most recent call last):
            ...
            ValueError: predict's x has token ids in [1, 64] ...
        """
        vocabulary_size = self.backbone.vocabulary_size
        if isinstance(x, Mapping):
            for key in self.token_id_inputs:
                if _is_array_like(x.get(key)):
                    check_token_ids(x[key], vocabulary_size, f"{where}'s x[{key!r}]")
        elif _is_array_like(x):
            check_token_ids(x, vocabulary_size, f"{where}'s x")
        if self.token_id_labels and _is_array_like(y):
            check_token_ids(y, vocabulary_size, f"{where}'s y")

    def token_id_alarm(self, ids):
        """In the compiled step: ``0.0`` if every id of ``ids`` lies in ``[0,
        vocabulary_size)``, else NaN (add it to the loss or the outputs: never a silent
        0.0 loss). A bad range is also recorded on the host (a ``jax.debug.callback``), and
        ``fit``/``evaluate``/``predict`` raise a ``ValueError`` naming it at the next batch
        end (a failing callback inside the step would lose the donated weights instead).

        Example:
            >>> from kdist.models import GPTCausalLM
            >>> lm = GPTCausalLM.from_preset("gpt-nano", vocabulary_size=64, num_layers=1)
            >>> float(lm.token_id_alarm(np.array([[0, 63]])))
            0.0
        """
        import jax

        vocabulary_size = self.backbone.vocabulary_size
        ids = ops.cast(ids, "int32")
        low, high = ops.min(ids), ops.max(ids)
        jax.debug.callback(functools.partial(self._token_id_findings().record, vocabulary_size),
                           low, high)
        bad = ops.logical_or(low < 0, high >= vocabulary_size)
        return ops.where(bad, float("nan"), 0.0)

    def call(self, inputs, training=None, mask=None):
        return self.input_alarm(inputs, super().call(inputs, training=training, mask=mask))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return self.label_alarm(y, loss)

    # === Parts a pipeline schedule runs (the "scheduled_pipeline" step feature) ===

    def schedule_parts(self, inputs, y, sample_weight):
        """The training forward pass cut where a pipeline schedule needs it, for one batch:
        :class:`kdist.parallel.pipeline.transform.ScheduleParts` (called inside Keras'
        stateless scope; tasks declaring ``"scheduled_pipeline"`` implement it)."""
        raise NotImplementedError(f"{type(self).__name__} does not expose schedule parts.")

    def head_loss(self, weights, hidden, targets):
        """One microbatch's summed (weighted) loss of ``hidden`` ``(b, T, D)`` against its
        ``targets``, the head run statelessly on ``weights`` (a list per head layer)."""
        raise NotImplementedError(f"{type(self).__name__} has no head loss.")

    def finish_loss(self, y, loss, extra_losses=None):
        """A loss the task computed itself plus the layers' losses (``extra_losses``, default
        ``self.losses``) and the label alarm."""
        for extra in self.losses if extra_losses is None else extra_losses:
            loss = loss + _keras_compat.aggregate_additional_loss(self, extra)
        return self.label_alarm(y, loss)

    def input_alarm(self, inputs, outputs):
        """``outputs`` plus the inputs' :meth:`token_id_alarm` if ``check_token_ids``."""
        if not getattr(self, "check_token_ids", False):
            return outputs
        ids = inputs[self.token_id_inputs[0]] if isinstance(inputs, Mapping) else inputs
        return outputs + ops.cast(self.token_id_alarm(ids), outputs.dtype)

    def label_alarm(self, y, loss):
        """``loss`` plus the token-id labels' :meth:`token_id_alarm` if ``check_token_ids``."""
        checked = getattr(self, "check_token_ids", False) and self.token_id_labels
        return loss + self.token_id_alarm(y) if checked and y is not None else loss

    def _with_id_check(self, kwargs: dict) -> dict:
        """``kwargs`` of fit/evaluate/predict with the callback that raises for ids the
        in-graph check (``check_token_ids=True``) found out of range."""
        if not getattr(self, "check_token_ids", False):
            return kwargs
        findings = self._token_id_findings()
        findings.found = None
        callbacks = list(kwargs.get("callbacks") or [])
        return {**kwargs, "callbacks": [*callbacks, _RaiseOnBadTokenIds(findings)]}

    def _token_id_findings(self) -> _TokenIdFindings:
        self._id_findings = getattr(self, "_id_findings", None) or _TokenIdFindings()
        return self._id_findings

    # === Cost model ===

    def cost_model(self) -> CostModel:
        """The family's cost model for this (built) task.

        Example:
            >>> from kdist.models import GPTCausalLM
            >>> lm = GPTCausalLM.from_preset("gpt-nano", vocabulary_size=64, num_layers=1)
            >>> lm.cost_model().parameters == sum(w.numpy().size for w in lm.trainable_weights)
            True
        """
        config = self.get_config()
        task_args = {k: config[k] for k in constructor_arguments(type(self)) if k != "backbone"}
        return self.cost_model_for(self.backbone.get_config(), **task_args)

    @classmethod
    def cost_model_for(cls, backbone_config: Mapping[str, Any], **task_args) -> CostModel:
        """The cost model of a task of ``backbone_config`` (a preset's dict will do: missing
        arguments take the constructor's defaults), without building a model."""
        raise NotImplementedError(f"{cls.__name__} has no cost model.")

    # === Config ===

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()  # name, trainable, dtype
        for name in constructor_arguments(type(self)):
            value = getattr(self, name)
            config[name] = (keras.saving.serialize_keras_object(value) if name == "backbone"
                            else value)
        return config

    @classmethod
    def from_config(cls, config):
        config = _deserialized_dtype(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)

    @classmethod
    def from_preset(cls, preset: str, **kwargs):
        """A randomly initialised task of a preset's shape: keyword arguments of the task's
        constructor go to it, the others override the backbone's preset fields.

        Example:
            >>> from kdist.models import BertClassifier
            >>> BertClassifier.from_preset("bert-tiny", num_classes=3, num_layers=1).num_classes
            3
        """
        task_args = {k: kwargs.pop(k) for k in list(kwargs)
                     if k in constructor_arguments(cls) and k != "backbone"}
        return cls(cls.backbone_class.from_preset(preset, **kwargs), **task_args)

    @classmethod
    def from_pretrained(cls, directory, **kwargs):
        """The task with the weights of a local Hugging Face model directory
        (``config.json`` + safetensors), each tensor streamed into its already-sharded
        variable under the active distribution (:mod:`kdist.models.hf`). Keyword arguments
        of the task's constructor go to it, the others override backbone config fields.

        Example:
            >>> lm = GPTCausalLM.from_pretrained("path/to/gpt2")  # doctest: +SKIP
        """
        from kdist.models import hf

        return hf.load_pretrained(cls, directory, **kwargs)

    def save_pretrained(self, directory, tokenizer=None, **kwargs):
        """Writes the model as a Hugging Face checkpoint, one tensor at a time from its
        shards (:func:`kdist.models.hf.export`); ``tokenizer`` adds its files."""
        from kdist.models import hf

        return hf.export(self, directory, tokenizer=tokenizer, **kwargs)


def _is_array_like(value) -> bool:
    """NumPy arrays, lists of ids and other host arrays; not datasets, generators, tensors
    of a graph or dicts."""
    if value is None or isinstance(value, (Mapping, str, bytes)):
        return False
    if isinstance(value, (np.ndarray, list)):
        return True
    return (hasattr(value, "__array__") and hasattr(value, "shape")
            and not hasattr(value, "element_spec")  # a tf.data dataset
            and getattr(value, "is_fully_addressable", True))  # a multi-process jax array


class _TokenIdFindings:
    """Host side of the in-graph token id check: the first bad range a step reported."""

    def __init__(self):
        self.found = None

    def record(self, vocabulary_size: int, low, high) -> None:
        if (low < 0 or high >= vocabulary_size) and self.found is None:
            self.found = (int(low), int(high), vocabulary_size)


class _RaiseOnBadTokenIds(keras.callbacks.Callback):
    """Raises the in-graph check's finding (``Task.token_id_alarm``) on the host."""

    def __init__(self, findings: _TokenIdFindings):
        super().__init__()
        self.findings = findings

    def _check(self, *_args, **_kwargs):
        found, self.findings.found = self.findings.found, None
        if found is not None:
            check_id_range(*found, "A batch in the compiled step", fix=(
                "Check the dataset's tokenizer and vocabulary_size against the model's "
                "(kdist.data.check_token_ids checks host arrays)."))

    on_train_batch_end = on_test_batch_end = on_predict_batch_end = _check
    on_train_end = on_test_end = on_predict_end = _check
