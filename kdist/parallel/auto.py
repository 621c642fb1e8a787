"""Sharding for Keras models that have no kdist logical-axes table.

keras-hub's ``GPT2Backbone``, ``BertBackbone``, ``LlamaBackbone``, ``GemmaBackbone`` or a
user's own model: :func:`infer_axes` gives each weight its mesh axes from its path and shape.

* **Tensor parallel by recognised structure** (Megatron-LM): query/key/value projections
  and MLP up/gate projections are column-parallel (their heads or output features over
  ``model``), the attention output and MLP down projections row-parallel (their input
  heads or features over ``model``), token embeddings by vocabulary. Layer names are
  matched against :data:`COLUMN_PARALLEL`, :data:`ROW_PARALLEL` and :data:`EMBEDDINGS`
  (keras-hub's, Hugging Face's and kdist's names).
* **FSDP by shape**: every weight above ``replicate_below`` elements has its largest
  dimension that divides by ``fsdp`` (and is not already on ``model``) sharded over
  ``fsdp`` — for token embeddings, the embedding dimension (kdist's own ``embed -> fsdp``).
* A large weight that ends up replicated although the mesh has an axis it could use (no
  dimension divides) is an error naming the weight, its shape and the axis, unless its
  path matches one of ``allow_replicated`` (regexes).

The convention for 3-D attention kernels: keras-hub writes query/key/value as
``(hidden, heads, head_dim)`` (Gemma: ``(heads, hidden, head_dim)``) and the output as
``(heads, head_dim, hidden)``; the heads dimension of a query/key/value kernel is the
smaller of the first two (hidden = heads x head_dim >= heads).

Use it through the distribution: ``kdist.distribution("fsdp=4,model=2", auto_shard=True)``;
:func:`kdist.parallel.coverage.coverage_report` lists every weight with its layout and the
rule that gave it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

# Layer names (the path component before the variable name), matched with re.fullmatch.
COLUMN_PARALLEL = (
    r"query|key|value|query_dense|key_dense|value_dense|q_proj|k_proj|v_proj|qkv|c_attn"
    r"|feedforward_intermediate_dense|feedforward_gate_dense|ffw_gating(_2)?|gate_proj"
    r"|up_proj|intermediate_dense|up|gate|fc1|c_fc|wi(_\d)?|dense_h_to_4h"
)
ROW_PARALLEL = (
    r"attention_output|o_proj|out_proj|attention_output_dense|feedforward_output_dense"
    r"|ffw_linear|down_proj|down|fc2|wo|dense_4h_to_h"
)
EMBEDDINGS = r"token_embedding|embed_tokens|wte|word_embeddings|token_embeddings"
_ATTENTION_IN = r"query|key|value|query_dense|key_dense|value_dense|q_proj|k_proj|v_proj|qkv"


def _rule(path: str) -> str | None:
    """``"column"``, ``"row"``, ``"vocab"`` or None for a weight path."""
    parts = path.split("/")
    layer, name = (parts[-2] if len(parts) > 1 else ""), parts[-1]
    if re.fullmatch(EMBEDDINGS, layer) and name in ("embeddings", "reverse_embeddings"):
        return "vocab"
    if name not in ("kernel", "bias", "w", "weight"):
        return None
    if re.fullmatch(COLUMN_PARALLEL, layer):
        return "column"
    if re.fullmatch(ROW_PARALLEL, layer):
        return "row"
    return None


def _model_dim(path: str, shape: tuple[int, ...], rule: str) -> int | None:
    """Which dimension tensor parallelism splits, or None (e.g. a row-parallel bias)."""
    name = path.split("/")[-1]
    layer = path.split("/")[-2] if "/" in path else ""
    if rule == "vocab":
        return 1 if name == "reverse_embeddings" else 0
    if rule == "column":
        if name == "bias":
            return 0  # (heads, head_dim) or (features,)
        if len(shape) == 3 and re.fullmatch(_ATTENTION_IN, layer):
            return 0 if shape[0] < shape[1] else 1  # heads: the smaller of the first two
        return len(shape) - 1 if len(shape) == 2 else 1
    if rule == "row":
        return None if name == "bias" else 0  # (heads, head_dim, D) or (features, D)
    return None


class ShardingError(ValueError):
    """A weight that cannot be sharded as the mesh asks."""


def infer_axes(
    path: str,
    shape: Sequence[int],
    mesh_shape: dict[str, int],
    *,
    replicate_below: int = 4096,
    allow_replicated: Sequence[str] = (),
) -> tuple[tuple[str | None, ...], str]:
    """Mesh axes for one weight (one entry per dimension) and the rule that chose them.

    Example:
        >>> infer_axes("block_0/attention/query/kernel", (128, 8, 16),
        ...            {"data": 1, "fsdp": 4, "model": 2})
        (('fsdp', 'model', None), 'column-parallel + fsdp by shape')
        >>> infer_axes("layer_norm/gamma", (64,), {"data": 1, "fsdp": 8, "model": 1})
        ((None,), 'replicated (small)')
    """
    shape = tuple(int(s) for s in shape)
    axes: list[str | None] = [None] * len(shape)
    rules = []
    allowed = any(re.fullmatch(p, path) or re.search(p, path) for p in allow_replicated)
    model, fsdp = mesh_shape.get("model", 1), mesh_shape.get("fsdp", 1)
    rule = _rule(path)
    if rule is not None and model > 1:
        dim = _model_dim(path, shape, rule)
        if dim is not None:
            if shape[dim] % model == 0:
                axes[dim] = "model"
                rules.append({"column": "column-parallel", "row": "row-parallel",
                              "vocab": "vocab-parallel"}[rule])
            elif not allowed:
                raise ShardingError(
                    f"Weight '{path}' (shape {shape}) cannot be sharded over the 'model' mesh "
                    f"axis: it is {rule}-parallel along dimension {dim} (size {shape[dim]}), "
                    f"which does not divide by model={model}. Use a 'model' size among "
                    f"{[d for d in range(1, 65) if shape[dim] % d == 0]}, or pass "
                    f"allow_replicated=[{path!r}] to keep it replicated over 'model'."
                )
    size = math.prod(shape)
    if fsdp > 1 and size > replicate_below:
        free = [d for d in range(len(shape)) if axes[d] is None and shape[d] % fsdp == 0]
        if rule == "vocab" and len(shape) == 2:
            # A token table's embed dimension, as kdist's own rules (embed -> fsdp): a
            # lookup then yields embed-sharded rows instead of a gather across devices.
            embed = 1 - _model_dim(path, shape, rule)
            free = [embed] if embed in free else free
        if free:
            dim = max(free, key=lambda d: (shape[d], -d))
            axes[dim] = "fsdp"
            rules.append("fsdp by shape")
        elif not allowed:
            raise ShardingError(
                f"Weight '{path}' (shape {shape}, {size:,} elements) cannot be sharded over "
                f"the 'fsdp' mesh axis: no free dimension divides by fsdp={fsdp}, so it would "
                f"be replicated on every device. Use an 'fsdp' size that divides one of "
                f"{[shape[d] for d in range(len(shape)) if axes[d] is None]}, or pass "
                f"allow_replicated=[{path!r}] to accept the replication."
            )
    if not rules:
        rules.append("replicated (allowed)" if allowed and size > replicate_below
                     else "replicated (small)" if size <= replicate_below else "replicated")
    if rules[0] == "replicated" and size > replicate_below and model > 1 and fsdp == 1 \
            and not allowed:
        raise ShardingError(
            f"Weight '{path}' (shape {shape}, {size:,} elements) is not a recognised "
            f"tensor-parallel weight, so on this mesh (model={model}, no fsdp) it would be "
            f"replicated on every device. Add an fsdp axis (e.g. 'fsdp=2,model={model}'), "
            f"rename its layer to a recognised name (kdist.parallel.auto.COLUMN_PARALLEL / "
            f"ROW_PARALLEL), or pass allow_replicated=[{path!r}].")
    return tuple(axes), " + ".join(rules)
