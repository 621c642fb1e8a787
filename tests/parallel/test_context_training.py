"""Sequences split over the ``seq`` axis: predictions, metrics and generation are those of
one device; the ring's compiled step sends exactly the key/value blocks it should; bad
inputs fail before anything compiles. (That training equals 1-device training — every mesh
``seq`` combines with, both attention variants, GPT-2 and Llama-style, documents, BERT
padding, a scanned stack, bf16 — is the ``seq`` rows of tests/parallel/combinations.py; a
scanned stack against the unstacked model is here.)"""

from unittest import mock

import keras
import numpy as np
import pytest

import kdist
from kdist import hlo
from kdist.models import GPTBackbone, GPTCausalLM
from kdist.models.stacking import match_layer_layout, unstack_layer_weights
from kdist.parallel.context import SequenceLayout
from kdist.parallel.context import layer as context_layer
from kdist.parallel.context.cost import ring_bytes
from kdist.planning.compile import compile_train_step
from tests.helpers import TINY_GPT, TINY_LLAMA, token_batches, weights
from tests.parallel.harness import FAMILIES, OPTIMIZERS, TOLERANCES, reference_run

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
CONFIGS = {
    "gpt": TINY_GPT,
    "gpt-documents": {**TINY_GPT, "document_mask": True},
    "llama": TINY_LLAMA,  # RoPE, grouped-query attention, RMSNorm, SwiGLU, untied
    "llama-documents": {**TINY_LLAMA, "document_mask": True},
    "llama3-rope": {**TINY_LLAMA, "rope_scaling": LLAMA3_ROPE},  # scaled frequencies
}


def _gpt(mesh, config, variant="all_gather", seed=0, **options):
    keras.distribution.set_distribution(
        kdist.distribution(mesh, context_parallel=variant, **options) if mesh else None)
    keras.utils.set_random_seed(seed)
    return GPTCausalLM(GPTBackbone(**CONFIGS[config]))


def test_predictions_metrics_and_generation_are_those_of_one_device():
    x, y = token_batches(1)[0]
    one = _gpt(None, "llama3-rope")
    one.compile(optimizer="adamw", metrics=["accuracy"])
    want_logits, want_eval = one.predict_on_batch(x), one.evaluate(x, y, verbose=0)
    want_tokens = one.generate(x[:2, :4], 12, sampler="greedy")
    keras.utils.clear_session()
    split = _gpt("seq=8", "llama3-rope", "ring")
    split.set_weights(one.get_weights())
    split.compile(optimizer="adamw", metrics=["accuracy"])
    # predict: contiguous split (no step); evaluate: the balanced layout, undone for the
    # accuracy, which compares predictions with labels token by token.
    np.testing.assert_allclose(split.predict_on_batch(x), want_logits, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(split.evaluate(x, y, verbose=0), want_eval, rtol=2e-6)
    np.testing.assert_array_equal(split.generate(x[:2, :4], 12, sampler="greedy"),
                                  want_tokens)


def test_ring_step_sends_exactly_the_key_value_blocks():
    """The compiled train step of a 2-layer GPT on seq=8: every collective-permute is one
    key/value (or key/value gradient) block, their bytes are the ring's count, and no
    all-gather carries keys or values."""
    batch, length = 8, 32
    layout = SequenceLayout(length, 8, balanced=True)
    model = _gpt("seq=8", "llama", "ring")  # 4 key/value heads of 8: GQA sends only those
    model.compile(optimizer="adamw")
    ids = np.zeros((batch, length), "int32")
    compiled, _ = compile_train_step(model, ids, ids, keras.distribution.distribution())
    found = hlo.parse_collectives(compiled.as_text(), 8)
    kv_heads, head_dim = TINY_LLAMA["num_key_value_heads"], 8
    block = batch * layout.local_length * kv_heads * head_dim * 4
    permutes = [c for c in found if c.kind == "collective-permute"]
    assert {c.bytes for c in permutes} == {block}
    # Per layer: 2 x 7 forward, 4 x 7 + 2 backward (ring steps are a loop: its transfers
    # run once per iteration).
    assert sum(c.executions for c in permutes) == 44 * 2  # 2 layers
    want = ring_bytes(layout, batch, kv_heads, head_dim, 4)["total"] * 2
    assert sum(c.wire_bytes * c.executions for c in permutes) == want
    gathered = batch * length * kv_heads * head_dim * 4  # a layer's whole keys or values
    assert not [c for c in found if c.kind == "all-gather" and c.bytes >= gathered]


def test_all_gather_step_gathers_keys_and_values():
    batch, length = 8, 32
    model = _gpt("seq=8", "llama", "all_gather")
    model.compile(optimizer="adamw")
    ids = np.zeros((batch, length), "int32")
    compiled, _ = compile_train_step(model, ids, ids, keras.distribution.distribution())
    found = hlo.parse_collectives(compiled.as_text(), 8)
    gathered = batch * length * TINY_LLAMA["num_key_value_heads"] * 8 * 4
    assert sum(c.kind == "all-gather" and c.bytes == gathered for c in found) == 2 * 2
    assert not [c for c in found if c.kind == "collective-permute"]


def test_bad_sequence_lengths_fail_before_compiling_with_valid_lengths():
    model = _gpt("seq=8", "gpt")
    model.compile(optimizer="adamw")
    x = np.zeros((8, 20), "int32")  # 20: neither 2 x 8 nor 8 divide it
    with pytest.raises(ValueError, match=r"does not divide by 16.*e\.g\. 16 or 32"):
        model.train_on_batch(x, x)
    keras.utils.clear_session()
    unbalanced = _gpt("seq=8", "gpt", load_balance=False)
    unbalanced.compile(optimizer="adamw")
    with pytest.raises(ValueError, match=r"does not divide by 8.*e\.g\. 16 or 24"):
        unbalanced.train_on_batch(x, x)


def test_unsupported_combinations_are_refused():
    with pytest.raises(ValueError, match="context_parallel must be one of"):
        kdist.distribution("seq=8", context_parallel="ulysses")
    with pytest.raises(ValueError, match="load_balance must be True or False"):
        kdist.distribution("seq=8", load_balance="yes")

    class Unsplit(GPTCausalLM):  # a task whose attention knows nothing of the split
        step_features = frozenset({"fused_loss"})

    keras.distribution.set_distribution(kdist.distribution("seq=8"))
    model = Unsplit(GPTBackbone(**TINY_GPT))
    with pytest.raises(ValueError, match="does not declare the 'context_parallel'"):
        model.compile(optimizer="adamw")
    keras.distribution.set_distribution(kdist.distribution("seq=2,model=4"))
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 .* 'model' size among \[1, 2\]"):
        GPTBackbone(**{**TINY_LLAMA, "num_key_value_heads": 2})


def test_a_scanned_stack_under_seq_trains_like_the_unstacked_blocks_on_one_device():
    """The scanned stack (one block in a ``lax.scan``) under ``seq=4,data=2`` against the
    *unstacked* 1-device model (the harness' memoised reference), started from its initial
    weights stacked by the converter: the split attention runs in the scan body, and the
    losses and the unstacked final weights are the reference's (float32 tolerance). (The
    ``config=scanned`` seq row compares scanned with scanned.)"""
    family = FAMILIES["llama-documents"]
    tol = TOLERANCES["float32"]
    reference = reference_run("llama-documents", None, config=None, task=None, steps=3,
                              rows=8, optimizer="adamw", dtype_policy="float32", seed=0)
    keras.utils.clear_session()
    keras.config.set_dtype_policy("float32")
    keras.distribution.set_distribution(kdist.distribution("seq=4,data=2",
                                                           context_parallel="ring"))
    model = GPTCausalLM(GPTBackbone(**family.config, scan_layers=True))
    values = match_layer_layout(reference.initial, {w.path: w.shape for w in model.weights})
    for w in model.weights:
        w.assign(values[w.path])
    model.compile(optimizer=OPTIMIZERS["adamw"]())
    with mock.patch.object(context_layer, "local_attention",
                           wraps=context_layer.local_attention) as spy:
        losses = [family.step(model, batch) for batch in reference.batches]
    assert spy.call_count >= 1  # traced in the scan body
    np.testing.assert_allclose(losses, reference.losses, rtol=tol.loss_rtol, atol=0)
    unstacked = unstack_layer_weights(weights(model))
    assert sorted(unstacked) == sorted(reference.final)
    for path, value in reference.final.items():
        np.testing.assert_allclose(unstacked[path], value, rtol=0, atol=tol.weight_atol,
                                   err_msg=path)
