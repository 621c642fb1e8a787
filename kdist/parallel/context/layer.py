"""What an attention layer calls when its sequence is split over ``seq``.

:func:`attention` takes the layer's queries, keys and values ``(B, L, heads, H)`` as the
layer has them: the whole sequence under XLA's partitioner (it enters a ``jax.shard_map``
over the mesh — batch over the replica axes, tokens over ``seq``, heads over ``model`` —
and leaves it with the same split), or one device's share inside kdist's per-device region
(explicit gradient reduction), where it runs as it is.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kdist.parallel import region
from kdist.parallel.context.attention import local_attention
from kdist.parallel.context.token_layout import AXIS, all_tokens, current_layout
from kdist.parallel.layout import active
from kdist.parallel.mesh import batch_axes


def key_valid_from_mask(mask, batch: int, keys: int):
    """A key-padding mask ``(Bm, 1, 1, S)`` as ``(B, S)`` booleans (None stays None).

    Under a split sequence attention builds its masks from what they mean — causality by
    true positions, documents by segment ids, padding by key — never from a ``(B, 1, T, S)``
    array, which would be ``O(T^2)`` per device.
    """
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    shape = tuple(mask.shape)
    if mask.ndim != 4 or shape[1:3] != (1, 1) or shape[0] not in (1, batch) or shape[3] != keys:
        raise ValueError(
            f"Attention over a sequence split by the 'seq' mesh axis takes a key-padding mask "
            f"of shape (B, 1, 1, S) = ({batch}, 1, 1, {keys}), or documents as segment_ids; got "
            f"a mask of shape {shape}. Pass segment ids for same-document masks, or train "
            f"without a 'seq' axis.")
    return jnp.broadcast_to(mask[:, 0, 0].astype(bool), (batch, keys))


def attention(q, k, v, *, mask=None, segment_ids=None, causal: bool = True,
              chunk_size: int | None = None):
    """Attention of ``q (B, L, N, H)`` over ``k``/``v (B, L, K, H)`` whose length ``L`` is
    split over ``seq`` (:func:`~kdist.parallel.context.token_layout.current_layout` is not None).

    Args:
        mask: None or a key-padding mask ``(B, 1, 1, L)`` (True: a real key).
        segment_ids: None or ``(B, L)`` document ids: queries see their own document only.
        causal: queries see keys at true positions up to their own.
        chunk_size: keys per chunk of the online softmax (the layer's
            ``attention_chunk_size``; default ``DEFAULT_CHUNK``).

    Returns ``(B, L, N, H)``, split like ``q``.
    """
    length = q.shape[1]
    layout = current_layout(length)
    if layout is None:
        raise ValueError(f"A sequence of {length} tokens is not split over 'seq' here.")
    dist = active()
    key_valid = key_valid_from_mask(mask, q.shape[0], length)
    options = dict(layout=layout, variant=dist.config.context.variant, causal=causal,
                   chunk_size=chunk_size)
    if region.current().tokens_split:  # one device's tokens; the masks' data of every token
        return local_attention(q, k, v, segments=all_tokens(segment_ids),
                               key_valid=all_tokens(key_valid), **options)
    sizes = dist.mesh_shape
    mesh = dist.device_mesh.backend_mesh
    axes = region.current().automatic(mesh.axis_names)  # a replica group's are its own
    replicas = batch_axes(sizes, axes)
    # A batch that does not divide over the replicas (one prompt) is computed by each.
    rows = replicas if replicas and q.shape[0] % math.prod(sizes[a] for a in replicas) == 0 \
        else None
    heads = P(rows, AXIS, "model" if sizes["model"] > 1 and "model" in axes else None, None)
    side = [x for x in (segment_ids, key_valid) if x is not None]

    def per_device(q, k, v, *side_data):
        data = iter(side_data)
        segments = next(data) if segment_ids is not None else None
        valid = next(data) if key_valid is not None else None
        return local_attention(q, k, v, segments=segments, key_valid=valid, **options)

    # The masks' data of every token (B, L): replicated over seq, as the inputs are.
    in_specs = (heads, heads, heads) + (P(rows, None),) * len(side)
    return region.shard_map(per_device, mesh=mesh, axes=axes, in_specs=in_specs,
                            out_specs=heads)(q, k, v, *side)
