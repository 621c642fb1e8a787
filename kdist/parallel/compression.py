"""8-bit gradient exchange: quantised bytes on the wire, every sum in float32.

A gradient reduction over ``N`` devices is, for 8-bit codes, two collectives (the scheme of
ZeRO++'s quantised gradients and 1-bit Adam's compressed all-reduce):

1. **all-to-all**: each device cuts its partial gradient into ``N`` chunks (chunk ``i``
   is the part device ``i`` will own), quantises every block of :data:`BLOCK` values to 8
   bits with one float32 scale (``max |x| / code_max``), and sends chunk ``i`` to device
   ``i`` as ``uint8`` bytes — codes and the scale's four bytes in one buffer. Device ``i``
   decodes the ``N`` chunks it received and sums them **in float32**: its chunk of the
   reduced gradient. Nothing is ever added in 8 bits.
2. **all-gather** (only over the axes where the owners of one shard differ: ``data``, not
   ``fsdp``, for a weight sharded over ``fsdp``): each owner quantises its summed chunk
   again and the chunks are gathered, as bytes, to everyone holding the shard; all decode
   the same bytes, so the replicas stay identical.

Per device that sends ``(N-1)/N`` of the gradient once plus ``(D-1)/D`` of its shard at
one byte per value (plus ``4 / BLOCK`` bytes of scale per value): a quarter of the float32
ring reduction's bytes. Codes travel as ``uint8`` because XLA:CPU promotes float8
collectives to 16 bits; the HLO shows ``u8`` on the wire.

Formats: ``"float8"`` is ``float8_e4m3fn`` (3 mantissa bits: relative error at most 2^-4
of a value, values below ~2^-9 of the block's maximum lose all precision); ``"int8"`` is
symmetric integers in [-127, 127] (error at most ``max|x| / 254`` per value, uniform over
the block). Error feedback (``error_feedback=True`` on the distribution) keeps what each
quantisation lost and adds it back at the next step (``reduce``'s ``residual``), so the
error does not accumulate in the weights.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Values per scale. A float32 scale per 256 values adds 4/256 = 1.6% to the bytes.
BLOCK = 256
FORMATS = {"float8": (jnp.float8_e4m3fn, 448.0), "int8": (jnp.int8, 127.0)}


def quantize(x, fmt: str):
    """``x (..., block)`` float32 -> ``(codes uint8 (..., block), scales float32 (...))``.

    Example:
        >>> codes, scales = quantize(jnp.linspace(-1, 1, 2 * BLOCK).reshape(2, BLOCK), "int8")
        >>> codes.dtype, scales.shape
        (dtype('uint8'), (2,))
    """
    dtype, code_max = FORMATS[fmt]
    peak = jnp.max(jnp.abs(x), axis=-1)
    scales = jnp.where(peak > 0, peak / code_max, 1.0)  # an all-zero block: any scale
    scaled = jnp.clip(x / scales[..., None], -code_max, code_max)  # never past the format
    if fmt == "int8":
        scaled = jnp.round(scaled)
    return jax.lax.bitcast_convert_type(scaled.astype(dtype), jnp.uint8), scales


def dequantize(codes, scales, fmt: str):
    """The float32 values of ``quantize``'s output."""
    dtype, _ = FORMATS[fmt]
    values = jax.lax.bitcast_convert_type(codes, dtype).astype(jnp.float32)
    return values * scales[..., None]


def _pack(codes, scales):
    """``(n, k, block)`` codes and ``(n, k)`` scales as one ``(n, k * (block + 4))`` bytes."""
    n = codes.shape[0]
    scale_bytes = jax.lax.bitcast_convert_type(scales, jnp.uint8)  # (n, k, 4)
    return jnp.concatenate([codes.reshape(n, -1), scale_bytes.reshape(n, -1)], axis=1)


def _unpack(buffer, blocks: int, block: int):
    n = buffer.shape[0]
    codes = buffer[:, : blocks * block].reshape(n, blocks, block)
    scales = jax.lax.bitcast_convert_type(
        buffer[:, blocks * block:].reshape(n, blocks, 4), jnp.float32)
    return codes, scales


def chunking(values: int, owners: int) -> tuple[int, int]:
    """``(block, chunk)``: values per scale and per owner's chunk for a shard of ``values``
    cut among ``owners``. Blocks of :data:`BLOCK`, smaller for a small shard so that the
    padding stays below one block per owner (a 64-value bias over 8 devices: 8 x 8).

    Example:
        >>> chunking(100_000, 8), chunking(64, 8)
        ((256, 12544), (8, 8))
    """
    block = min(BLOCK, -(-values // owners))
    return block, -(-values // (owners * block)) * block


def _linear_index(axes):
    return jax.lax.axis_index(axes) if axes else 0


def reduce(grad, residual, *, axes: tuple[str, ...], sizes: dict[str, int],
           fsdp_dim: int | None, fmt: str):
    """This device's shard of the sum of ``grad`` over the mesh ``axes``, exchanged in 8 bits.

    ``grad``: the device's float32 partial gradient of a whole weight (over ``fsdp``).
    Returns ``(shard, new_residual)``: the reduced gradient sharded like the weight —
    block ``axis_index("fsdp")`` along ``fsdp_dim`` when it is not None, else whole — and,
    when ``residual`` (the last step's quantisation error, ``grad``'s shape) is given, this
    step's error to carry to the next (else None). Call inside ``shard_map`` over ``axes``.

    Example:
        >>> shard, _ = reduce(g, None, axes=("data",), sizes={"data": 8}, fsdp_dim=None,
        ...                   fmt="float8")  # doctest: +SKIP
    """
    axes = tuple(axes)
    n = math.prod(sizes[a] for a in axes)
    fsdp = sizes["fsdp"] if fsdp_dim is not None else 1
    owners = tuple(a for a in axes if fsdp_dim is None or a != "fsdp")  # gather group
    d = n // fsdp
    # (F, m): the F fsdp shards of the weight, flattened; each cut into D chunks of c values.
    moved = jnp.moveaxis(grad, fsdp_dim, 0) if fsdp_dim is not None else grad[None]
    shard_shape = (moved.shape[0] // fsdp, *moved.shape[1:])
    m = math.prod(shard_shape)
    block, c = chunking(m, d)
    blocks = c // block

    # Chunk (shard f, owner j) goes to the device whose index is f over fsdp and j over
    # `owners`: its index over `axes`, in their order, is where jax.lax.all_to_all sends.
    grid = ((fsdp,) if fsdp > 1 else ()) + tuple(sizes[a] for a in owners)
    names = (("fsdp",) if fsdp > 1 else ()) + owners
    order = [names.index(a) for a in axes]  # (shard, *owners) -> the axes' order
    inverse = [order.index(i) for i in range(len(order))]

    def to_chunks(x):  # weight-shaped -> (N, c), chunk i for the device of linear index i
        x = jnp.moveaxis(x, fsdp_dim, 0) if fsdp_dim is not None else x[None]
        x = jnp.pad(x.reshape(fsdp, m), ((0, 0), (0, d * c - m))).reshape(*grid, c)
        return x.transpose(*order, len(order)).reshape(n, c)

    def from_chunks(x):  # the inverse of to_chunks
        x = x.reshape(*(grid[i] for i in order), c).transpose(*inverse, len(order))
        x = x.reshape(fsdp, d * c)[:, :m].reshape((fsdp * shard_shape[0], *shard_shape[1:]))
        return jnp.moveaxis(x, 0, fsdp_dim) if fsdp_dim is not None else x[0]

    chunks = to_chunks(grad.astype(jnp.float32))
    if residual is not None:
        chunks = chunks + to_chunks(residual)
    codes, scales = quantize(chunks.reshape(n, blocks, block), fmt)
    received = jax.lax.all_to_all(_pack(codes, scales), axes, 0, 0, tiled=True)
    mine = dequantize(*_unpack(received, blocks, block), fmt).sum(axis=0)  # (blocks, block)
    error = None
    if residual is not None:
        error = chunks - dequantize(codes, scales, fmt).reshape(n, c)
    if d > 1:  # every owner of this shard's chunks: gather the sums, as bytes
        codes2, scales2 = quantize(mine, fmt)
        if residual is not None:  # the owner keeps the requantisation error of its chunk
            lost = (mine - dequantize(codes2, scales2, fmt)).reshape(1, c)
            here = jax.nn.one_hot(_linear_index(axes), n, dtype=jnp.float32)[:, None]
            error = error + here * lost
        gathered = jax.lax.all_gather(_pack(codes2[None], scales2[None]), owners, axis=0,
                                      tiled=True, to="invarying")  # the same on every owner
        shard = dequantize(*_unpack(gathered, blocks, block), fmt).reshape(d * c)
    else:
        shard = mine.reshape(c)
    shard = shard[:m].reshape(shard_shape)
    shard = jnp.moveaxis(shard, 0, fsdp_dim) if fsdp_dim is not None else shard[0]
    return shard, (from_chunks(error) if error is not None else None)
