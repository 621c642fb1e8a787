"""The quantized vocabulary head (``GPTCausalLM(head_matmul_precision=...)``): the fused
chunked loss's three matmuls against a numpy reference of the same quantizer chunk by chunk
(tests/precision/reference.py), the logits path's matmul exactly, the model's wiring
(logits, pipeline head loss, config), refusals. The sharded fused loss: the combination
table's ``head_matmul_precision=int8`` row."""

import jax
import keras
import numpy as np
import pytest

import kdist
from kdist.models import GPTBackbone, GPTCausalLM
from kdist.models.losses import chunked_cross_entropy
from tests.helpers import TINY_GPT
from tests.precision import reference

B, T, D, ROWS, VOCAB, CHUNK = 2, 8, 16, 32, 30, 4  # two padding rows; two chunks


def _operands():
    # Seed 3: no value of g within _TIE_MARGIN of an int8 tie (_away_from_ties). Of seeds
    # 0-11, 3, 6 and 11 keep every value >= 9e-4 of a step from one; seed 1 has one 3e-6 off.
    rng = np.random.default_rng(3)
    hidden = rng.standard_normal((B, T, D)).astype(np.float32)
    hidden[0, 5] *= 4  # one token dominates its channels' scales in its chunk
    table = (rng.standard_normal((ROWS, D)) * 0.5).astype(np.float32)
    labels = rng.integers(0, VOCAB, (B, T)).astype(np.int32)
    return hidden, table, labels


def _softmax_gradient(logits, labels):
    """``(softmax - onehot) / tokens`` over the vocabulary's columns (padding: 0), float32."""
    z = logits[:, :VOCAB].astype(np.float64)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    g = np.zeros(logits.shape, np.float64)
    g[:, :VOCAB] = p - np.eye(VOCAB)[labels]
    return (g / (B * T)).astype(np.float32)


# How far (in code steps) every value of g must sit from an int8 tie. The reference's g
# (float64 softmax, rounded) and the loss's (float32 exp, sums and p - onehot) differ:
# measured <= 5.3e-5 of a step on these operands (a float32 replica of the loss's formula),
# more where p -> 1 cancels; 5e-4 is 9x that.
_TIE_MARGIN = 5e-4


def _away_from_ties(g):
    """Whether every value of ``g`` is far (:data:`_TIE_MARGIN`) from an int8 rounding
    boundary in both of its products' scalings: then the reference's and the loss's g,
    which differ by float32 rounding, have the same codes, and the gradients agree as
    float32 rescales of the same integers."""
    for axis in (0, 1):  # per token (grad_h), per vocabulary row (grad_table)
        _, scale = reference.int8(g, axis)
        v = np.abs(g / scale)
        if (np.abs(v - np.floor(v) - 0.5) < _TIE_MARGIN).any():
            return False
    return True


def _reference(hidden, table, labels):
    """Mean cross-entropy and its gradients, chunk by chunk over positions: logits =
    Q(h) Q(table)^T (h per token, the table per row, over D), grad_h = Q(g) Q(table) (g per
    token, the table per channel, over the vocabulary), grad_table = (Q(h)^T Q(g))^T (h
    per channel, g per row, over the chunk's tokens): int8_matmul's rules."""
    loss, grad_h, grad_table = 0.0, np.zeros_like(hidden), np.zeros_like(table)
    for c in range(T // CHUNK):
        h = hidden[:, c * CHUNK:(c + 1) * CHUNK].reshape(-1, D)
        y = labels[:, c * CHUNK:(c + 1) * CHUNK].reshape(-1)
        logits = reference.int8_product(h, table.T)  # exact: int32 sums
        z = logits[:, :VOCAB].astype(np.float64)
        lse = z.max(1) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1))
        loss += (lse - z[np.arange(len(y)), y]).sum()
        g = _softmax_gradient(logits, y)
        assert _away_from_ties(g)
        grad_h[:, c * CHUNK:(c + 1) * CHUNK] = reference.int8_product(g, table).reshape(
            B, CHUNK, D)
        grad_table += reference.int8_product(h.T, g).T
    return loss / (B * T), grad_h, grad_table


def _fused(precision):
    def loss(h, w, y):
        return chunked_cross_entropy(h, w, y, CHUNK, vocabulary_size=VOCAB,
                                     matmul_precision=precision)

    return jax.jit(jax.value_and_grad(loss, (0, 1)))


def test_the_fused_int8_head_is_the_chunked_reference():
    hidden, table, labels = _operands()
    loss, (grad_h, grad_table) = _fused("int8")(hidden, table, labels)
    ref_loss, ref_h, ref_table = _reference(hidden, table, labels)
    # The logits are exact (tested below through the layer); the loss sums float32 logs.
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-6)
    # The same codes (_away_from_ties), rescaled in float32: equal to its rounding.
    np.testing.assert_allclose(grad_h, ref_h, rtol=0, atol=1e-6 * np.abs(ref_h).max())
    np.testing.assert_allclose(grad_table, ref_table, rtol=0,
                               atol=1e-6 * np.abs(ref_table).max())
    assert not grad_table[VOCAB:].any()  # padding rows: no gradient
    # and it really quantized: the unquantized head is farther than int8 rounding's 1e-6
    plain, (plain_h, plain_table) = _fused("bf16")(hidden, table, labels)
    assert abs(float(plain) - ref_loss) > 1e-4 * ref_loss
    assert np.abs(plain_table - ref_table).max() > 1e-3 * np.abs(ref_table).max()


def test_the_sharded_fused_int8_head_is_one_devices():
    """Vocabulary over model, rows (and the table's D) over fsdp: every scale's maximum is
    reduced over the axes that split it, so the sharded loss and gradients are one device's
    but for float32 summation order (measured <= 1.9e-7 of the largest; 2e-6: float32's parity)."""
    hidden, table, labels = _operands()
    expected = _fused("int8")(hidden, table, labels)
    keras.distribution.set_distribution(kdist.distribution("fsdp=2,model=4"))
    sharded = _fused("int8")(hidden, table, labels)
    for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_the_logits_path_quantizes_the_head_matmul_exactly():
    """The LM's logits (predict, the unfused loss) are Q(hidden) Q(table)^T, int32-exact,
    padding rows cut; the pipeline's head loss is their cross-entropy."""
    keras.utils.set_random_seed(0)
    lm = GPTCausalLM(GPTBackbone(**{**TINY_GPT, "num_layers": 1}),
                     head_matmul_precision="int8")
    x = np.random.default_rng(1).integers(0, 256, (2, 8)).astype("int32")
    hidden = np.asarray(lm.backbone(x)).reshape(-1, TINY_GPT["hidden_dim"])
    table = np.asarray(lm.backbone.token_embedding.embeddings)
    expected = reference.int8_product(hidden, table.T)
    np.testing.assert_array_equal(np.asarray(lm(x)).reshape(expected.shape), expected)
    plain = GPTCausalLM(lm.backbone)
    assert np.abs(np.asarray(plain(x)).reshape(expected.shape) - expected).max() > 1e-4
    # the pipeline schedules' head: the final norm then the same quantized logits
    norm, embedding = lm.backbone.final_norm, lm.backbone.token_embedding
    pre_norm = lm.backbone.get_layer("block_0")(lm.backbone.embed(x))
    weights = [[v.value for v in norm.trainable_variables],
               [v.value for v in embedding.trainable_variables]]
    labels = x[:, ::-1]
    summed = float(lm.head_loss(weights, pre_norm, labels))
    log_p = jax.nn.log_softmax(expected.astype(np.float64), axis=-1)
    np.testing.assert_allclose(summed, -np.take_along_axis(
        log_p, labels.reshape(-1, 1), 1).sum(), rtol=1e-6)


def test_head_matmul_precision_round_trips_and_bad_values_are_named():
    backbone = GPTBackbone(**{**TINY_GPT, "num_layers": 1})
    lm = GPTCausalLM(backbone, head_matmul_precision="fp8")
    assert GPTCausalLM.from_config(lm.get_config()).head_matmul_precision == "fp8"
    assert GPTCausalLM(backbone).head_matmul_precision == "bf16"  # off by default
    with pytest.raises(ValueError, match="head_matmul_precision='int4'.*'bf16'"):
        GPTCausalLM(backbone, head_matmul_precision="int4")
    hidden, table, labels = _operands()
    with pytest.raises(ValueError, match="matmul_precision='float8'"):
        chunked_cross_entropy(hidden, table, labels, CHUNK, matmul_precision="float8")
