"""Initialise a task model's backbone from a pretraining run's saved model.

One entry point, :func:`load_backbone_weights`, so that every source of pretrained weights
goes through the same checks: each backbone weight of the target must exist in the source
under the same path and with the same shape, else a ``ValueError`` names the weight and
both shapes — nothing is loaded partially or broadcast silently.

Sources today: a ``.keras`` file written by ``model.save`` (what ``recipes/bert_pretrain.py``
writes), or a directory holding one as ``model.keras``. A checkpoint directory of
``kdist.callbacks.Checkpoint`` (orbax) is the next source to add: read its state tree's
trainable variables into ``_source_weights``'s ``{path: array}`` form and the rest of this
function applies unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path

import keras
import numpy as np

from kdist.models.stacking import match_layer_layout


def _source_weights(source: Path) -> dict[str, np.ndarray]:
    """``{weight path relative to the backbone: value}`` of the backbone saved at ``source``."""
    if source.is_dir():
        if not (source / "model.keras").exists():
            raise ValueError(
                f"{source} is a directory without a model.keras file. Pass the output "
                f"directory of a pretraining run (it holds model.keras) or a .keras file."
            )
        source = source / "model.keras"
    if source.suffix != ".keras" or not source.is_file():
        raise ValueError(
            f"Cannot read pretrained weights from {source}: expected an existing .keras file "
            f"(written by model.save, e.g. runs/bert_pretrain/model.keras) or the directory "
            f"holding it."
        )
    # Loaded without a distribution: the source is read on the host once, then assigned
    # into the target's (possibly sharded) variables.
    current = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        saved = keras.saving.load_model(source, compile=False)
    finally:
        keras.distribution.set_distribution(current)
    backbone = getattr(saved, "backbone", saved)
    return {w.path: np.asarray(w.value) for w in backbone.weights}


def load_backbone_weights(model, source: str | os.PathLike) -> list[str]:
    """Copies the pretrained backbone weights at ``source`` into ``model.backbone``, exactly.

    ``model`` is a task model with a ``backbone`` (e.g. ``BertClassifier``) or a backbone.
    Its blocks may be stacked (``scan_layers=True``, a pipeline) where the source's are not,
    or the other way round: :mod:`kdist.models.stacking` converts them exactly.
    ``source`` is a ``.keras`` file of a model with a backbone of the same shape (e.g. a
    ``BertMaskedLM`` saved by ``recipes/bert_pretrain.py``) or the directory holding it as
    ``model.keras``. Every weight of the target backbone is matched by path; a missing weight
    or a different shape (another preset, another vocabulary) raises a ``ValueError`` naming
    the weight and both shapes, before any weight is changed. Weights outside the backbone
    (the task head) are left as they are. Returns the paths loaded.

    Example:
        >>> from kdist.models import BertClassifier, BertMaskedLM
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "mlm.keras")
        >>> BertMaskedLM.from_preset("bert-tiny", vocabulary_size=64).save(path)
        >>> clf = BertClassifier.from_preset("bert-tiny", num_classes=2, vocabulary_size=64)
        >>> len(load_backbone_weights(clf, path)) == len(clf.backbone.weights)
        True
    """
    backbone = getattr(model, "backbone", model)
    saved = _source_weights(Path(source))
    try:  # blocks stacked in one and unstacked in the other (scan_layers): converted
        saved = match_layer_layout(saved, {w.path: tuple(w.shape) for w in backbone.weights})
    except ValueError:
        pass  # another difference: named weight by weight below
    problems = []
    for weight in backbone.weights:
        if weight.path not in saved:
            problems.append(f"'{weight.path}' (shape {tuple(weight.shape)}) is missing from "
                            f"the pretrained weights")
        elif tuple(saved[weight.path].shape) != tuple(weight.shape):
            problems.append(f"'{weight.path}' has shape {tuple(saved[weight.path].shape)} in "
                            f"the pretrained weights but {tuple(weight.shape)} in this model")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if
                                           len(problems) > 5 else "")
        raise ValueError(
            f"The pretrained weights at {source} do not fit this model's backbone: {shown}. "
            f"Build the model with the pretraining run's preset and vocabulary size (see its "
            f"summary.json), or train from scratch."
        )
    for weight in backbone.weights:
        weight.assign(saved[weight.path].astype(weight.dtype))
    return [w.path for w in backbone.weights]
