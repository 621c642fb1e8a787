"""Context-parallel attention, per op: outputs and q/k/v gradients equal the unsplit
attention's; the work each device does (tiles) is what the layout says, equal across devices
when balanced; layouts, document positions and bad inputs."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from kdist.models.layers import document_mask_and_positions
from kdist.parallel.context import SequenceLayout, document_positions, local_attention
from kdist.parallel.context.attention import chunk_for, local_tile_count
from kdist.parallel.context.cost import attention_flops, causal_pairs, tile_counts
from kdist.parallel.context.layer import key_valid_from_mask

B, T, N, K, H = 2, 64, 4, 2, 8  # grouped-query: 2 query heads per key/value head
SEGMENTS = np.stack([np.repeat([0, 1, 2, 3], [10, 22, 8, 24]),
                     np.sort(np.random.default_rng(1).integers(0, 5, T))])
LENGTHS = np.array([40, 64])  # real tokens per row (bidirectional, padding)


def _inputs():
    rng = np.random.default_rng(0)
    q, w = (jnp.asarray(rng.normal(size=(B, T, N, H)), "float32") for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(B, T, K, H)), "float32") for _ in range(2))
    return q, k, v, w


def _mesh(shape=(8,), names=("seq",)):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _split(layout, mesh, rows, **options):
    """The split attention as a function of whole arrays in true order."""
    order, inverse = layout.order(), layout.inverse()
    heads, side = P(rows, "seq"), P(rows, None)

    def per_device(q, k, v, segments, valid):
        return local_attention(q, k, v, layout=layout, segments=segments, key_valid=valid,
                               **options)

    attend = jax.shard_map(per_device, mesh=mesh, in_specs=(heads,) * 3 + (side, side),
                           out_specs=heads)

    def f(q, k, v, segments, valid):
        # Tokens (and every token's mask data) in layout order, the output back in true order.
        out = attend(*(x[:, order] for x in (q, k, v, segments, valid)))
        return out[:, inverse]

    return f


CASES = {  # name: (causal, documents, padding)
    "causal": (True, False, False),
    "causal-documents": (True, True, False),
    "bidirectional-padding": (False, False, True),
}


@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "contiguous"])
@pytest.mark.parametrize("variant", ["all_gather", "ring"])
@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_gradients_equal_the_unsplit_attention(case, variant, balanced):
    causal, documents, padding = CASES[case]
    q, k, v, w = _inputs()
    segments = jnp.asarray(SEGMENTS if documents else np.zeros((B, T)), "int32")
    valid = jnp.asarray(np.arange(T)[None] < LENGTHS[:, None] if padding else np.ones((B, T)),
                        bool)
    layout = SequenceLayout(T, 8, balanced)
    split = _split(layout, _mesh(), None, variant=variant, causal=causal, chunk_size=2)
    mask = valid[:, None, None, :]
    if documents:
        mask = mask & (segments[:, None, :, None] == segments[:, None, None, :])

    def reference(q, k, v):
        return keras.ops.dot_product_attention(q, k, v, mask=mask, is_causal=causal)

    def value_and_grads(attend):
        loss = lambda q, k, v: jnp.sum(attend(q, k, v) * w)  # noqa: E731
        return jax.jit(lambda q, k, v: (attend(q, k, v), jax.grad(loss, (0, 1, 2))(q, k, v)))

    ours = value_and_grads(lambda q, k, v: split(q, k, v, segments, valid))
    (got, got_grads), (want, want_grads) = ours(q, k, v), value_and_grads(reference)(q, k, v)
    np.testing.assert_allclose(got, want, atol=2e-6)
    for g, r, name in zip(got_grads, want_grads, "qkv"):
        np.testing.assert_allclose(g, r, atol=5e-6, err_msg=f"gradient of {name}")


@pytest.mark.parametrize("variant", ["all_gather", "ring"])
def test_rows_split_over_data_too(variant):
    q, k, v, w = _inputs()
    layout = SequenceLayout(T, 4, balanced=True)
    split = _split(layout, _mesh((2, 4), ("data", "seq")), "data", variant=variant,
                   chunk_size=4)
    zeros, ones = jnp.zeros((B, T), "int32"), jnp.ones((B, T), bool)
    got = jax.jit(split)(q, k, v, zeros, ones)
    np.testing.assert_allclose(got, keras.ops.dot_product_attention(q, k, v, is_causal=True),
                               atol=2e-6)


@pytest.mark.parametrize("variant", ["all_gather", "ring"])
def test_each_device_computes_the_tiles_its_layout_gives_it(variant):
    """Causal work per device: the (query run, key chunk) tiles its forward pass computed,
    counted on the devices, against the host's count from the layout; in FLOPs (``4 H``
    per query-key pair and head), equal across devices when balanced, ~2x spread when not."""
    q, k, v, _ = _inputs()
    flops = {}
    for balanced in (True, False):
        layout = SequenceLayout(T, 8, balanced)

        def count(q, k, v, layout=layout):
            return local_tile_count(q, k, v, layout=layout, variant=variant, chunk_size=2)[None]

        order = layout.order()
        counted = jax.jit(jax.shard_map(count, mesh=_mesh(), in_specs=(P(None, "seq"),) * 3,
                                        out_specs=P("seq")))(q[:, order], k[:, order],
                                                             v[:, order])
        np.testing.assert_array_equal(np.asarray(counted), tile_counts(layout, 2))
        flops[balanced] = attention_flops(layout, B, N, H, 2)
    balanced, contiguous = flops[True], flops[False]
    assert balanced.max() / balanced.min() - 1 <= 0.05  # measured: all equal
    assert contiguous.max() / contiguous.mean() > 1.8  # 1.85: device 7 does 12x device 0's
    assert contiguous.sum() == balanced.sum()  # the same causal work, spread differently


def test_attention_work_at_length():
    # gpt2-small's 12 heads of 64 at 16,384 tokens over 8 devices, tiles of 512.
    tiles = {b: tile_counts(SequenceLayout(16384, 8, b), 512) for b in (True, False)}
    assert tiles[True].tolist() == [66] * 8
    assert tiles[False].tolist() == [16 * i + 10 for i in range(8)]
    flops = {b: attention_flops(SequenceLayout(16384, 8, b), 1, 12, 64, 512) for b in tiles}
    assert len(set(flops[True])) == 1
    assert round(flops[False].max() / flops[False].mean(), 3) == 1.848
    # What the mask leaves: 1.875x without balancing, none with; the diagonal tiles are
    # computed whole: 3% more than the visible pairs, 52% of the full square's tiles.
    exact = {b: causal_pairs(SequenceLayout(16384, 8, b)) for b in tiles}
    assert len(set(exact[True])) == 1
    assert round(exact[False].max() / exact[False].mean(), 3) == 1.875
    assert round(flops[True].sum() / (exact[True].sum() * 4 * 12 * 64), 3) == 1.031
    assert tiles[True].sum() / 32 ** 2 == 528 / 1024


def test_layouts():
    layout = SequenceLayout(16, 4, balanced=True)  # chunks of 2
    assert layout.table().tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                       [6, 7, 8, 9]]
    assert (layout.order()[layout.inverse()] == np.arange(16)).all()
    assert SequenceLayout(16, 4, False).order().tolist() == list(range(16))
    assert chunk_for(layout, 512) == 2 and chunk_for(SequenceLayout(96, 4, True), 5) == 4
    with pytest.raises(ValueError, match=r"does not divide by 16.*e\.g\. 96 or 112.*load_bal"):
        SequenceLayout(100, 8, balanced=True)
    with pytest.raises(ValueError, match=r"does not divide by 8.*e\.g\. 96 or 104"):
        SequenceLayout(100, 8, balanced=False)


def test_document_positions_are_true_positions_in_layout_order():
    _, want = document_mask_and_positions(jnp.asarray(SEGMENTS))
    for balanced in (True, False):
        layout = SequenceLayout(T, 8, balanced)
        got = document_positions(jnp.asarray(SEGMENTS[:, layout.order()]), layout)
        np.testing.assert_array_equal(got, np.asarray(want)[:, layout.order()])


def test_masks_other_than_key_padding_are_refused_under_a_split():
    assert key_valid_from_mask(None, B, T) is None
    assert key_valid_from_mask(np.ones((1, 1, 1, T), bool), B, T).shape == (B, T)
    with pytest.raises(ValueError, match=r"\(B, 1, 1, S\).*segment ids"):
        key_valid_from_mask(np.ones((B, 1, T, T), bool), B, T)
    with pytest.raises(ValueError, match="context-parallel attention 'ulysses'"):
        local_attention(*_inputs()[:3], layout=SequenceLayout(T, 8, True), variant="ulysses")
