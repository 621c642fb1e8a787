"""Training with sequences split over the ``seq`` axis computes what 1-device training
computes (float32, rtol 2e-6 over 3 fit steps: losses and final weights), on every mesh it
combines with, both attention variants, GPT-2 and Llama-style, documents and BERT padding;
the ring's compiled step sends exactly the key/value blocks it should; bad inputs fail
before anything compiles."""

from unittest import mock

import keras
import numpy as np
import pytest

import kdist
from kdist import hlo
from kdist.models import BertBackbone, BertMaskedLM, GPTBackbone, GPTCausalLM
from kdist.models.stacking import match_layer_layout, unstack_layer_weights
from kdist.parallel.context import SequenceLayout
from kdist.parallel.context import layer as context_layer
from kdist.parallel.context.cost import ring_bytes
from kdist.planning.compile import compile_train_step
from tests.bert_helpers import TINY_BERT, mlm_batches, train_mlm
from tests.helpers import TINY_GPT, TINY_LLAMA, token_batches, train, weights

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
CONFIGS = {
    "gpt": TINY_GPT,
    "gpt-documents": {**TINY_GPT, "document_mask": True},
    "llama": TINY_LLAMA,  # RoPE, grouped-query attention, RMSNorm, SwiGLU, untied
    "llama-documents": {**TINY_LLAMA, "document_mask": True},
    "llama3-rope": {**TINY_LLAMA, "rope_scaling": LLAMA3_ROPE},  # scaled frequencies
}
# Each mesh trains every model once; across the three meshes each model meets both
# variants, and each mesh runs both variants with and without documents (tests/
# test_context.py checks every variant x layout x mask per op). Two cases reduce the
# gradients with kdist's explicit reduction (summed over seq like over a replica axis).
CASES = [
    ("seq=8", "gpt", "all_gather", None), ("seq=8", "gpt-documents", "ring", None),
    ("seq=8", "llama", "ring", "float32"), ("seq=8", "llama-documents", "all_gather", None),
    ("seq=4,data=2", "gpt", "ring", None), ("seq=4,data=2", "gpt-documents", "all_gather",
                                            "float32"),
    ("seq=4,data=2", "llama", "all_gather", None), ("seq=4,data=2", "llama-documents", "ring",
                                                    None),
    ("seq=2,fsdp=2,model=2", "gpt", "ring", None),
    ("seq=2,fsdp=2,model=2", "gpt-documents", "all_gather", None),
    ("seq=2,fsdp=2,model=2", "llama", "all_gather", None),
    ("seq=2,fsdp=2,model=2", "llama-documents", "ring", None),
]


def _batches(config):
    batches = token_batches(3)  # 8 rows of 16 tokens
    if not CONFIGS[config].get("document_mask"):
        return batches
    rng = np.random.default_rng(1)
    segments = np.sort(rng.integers(0, 4, (8, 16)), axis=1)  # packed documents per row
    return [({"token_ids": x, "segment_ids": segments}, y) for x, y in batches]


def _gpt(mesh, config, variant="all_gather", seed=0, **options):
    keras.distribution.set_distribution(
        kdist.distribution(mesh, context_parallel=variant, **options) if mesh else None)
    keras.utils.set_random_seed(seed)
    return GPTCausalLM(GPTBackbone(**CONFIGS[config]))


@pytest.fixture(scope="module")
def references():
    out = {}
    for config in ("gpt", "gpt-documents", "llama", "llama-documents"):
        model = _gpt(None, config)
        out[config] = train(model, _batches(config)), weights(model)
        keras.utils.clear_session()
    return out


def _assert_same_training(model, batches, reference):
    ref_losses, ref_weights = reference
    split = mock.patch.object(context_layer, "local_attention",
                              wraps=context_layer.local_attention)
    with split as spy:
        losses = train(model, batches)
    assert spy.call_count >= model.backbone.num_layers  # the split attention ran
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6, atol=0)
    for path, value in weights(model).items():
        np.testing.assert_allclose(value, ref_weights[path], rtol=0, atol=2e-6, err_msg=path)


@pytest.mark.parametrize("mesh, config, variant, reduction", CASES)
def test_float32_parity(mesh, config, variant, reduction, references):
    model = _gpt(mesh, config, variant, gradient_reduction=reduction)
    _assert_same_training(model, _batches(config), references[config])


def test_scanned_layer_stack_under_seq(references):
    """A scanned stack (``scan_layers=True``: one block in a ``lax.scan``) splits the
    sequence as unstacked blocks do: the split attention runs in the scan body, and the
    losses and (unstacked) weights equal 1-device training of the unstacked model, started
    from its initial weights (stacked by the converter)."""
    initial = weights(_gpt(None, "llama-documents"))
    keras.distribution.set_distribution(kdist.distribution("seq=4,data=2",
                                                           context_parallel="ring"))
    model = GPTCausalLM(GPTBackbone(**CONFIGS["llama-documents"], scan_layers=True))
    values = match_layer_layout(initial, {w.path: w.shape for w in model.weights})
    for w in model.weights:
        w.assign(values[w.path])
    ref_losses, ref_weights = references["llama-documents"]
    split = mock.patch.object(context_layer, "local_attention",
                              wraps=context_layer.local_attention)
    with split as spy:
        losses = train(model, _batches("llama-documents"))
    assert spy.call_count >= 1  # traced once, in the scan body
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6, atol=0)
    unstacked = unstack_layer_weights(weights(model))
    assert sorted(unstacked) == sorted(ref_weights)
    for path, value in ref_weights.items():
        np.testing.assert_allclose(unstacked[path], value, rtol=0, atol=2e-6, err_msg=path)


def test_bfloat16_parity():
    """mixed_bfloat16 on seq=4,data=2 (ring) against mixed_bfloat16 on 1 device.

    Tolerance as tests/test_parity.py's bfloat16 test, for the same reason: matmuls round
    to bfloat16 (2^-9 relative), and the split attention rounds other partial results
    (each key chunk's probabilities to bfloat16 before P V, as chunked attention does,
    where Keras' attention rounds once over all keys), so logits differ by a few bf16 ulps;
    the loss averages 128 token losses whose errors have independent signs. Allowed 2e-4
    relative, 100x below what the loss moves in 3 steps.
    """
    keras.config.set_dtype_policy("mixed_bfloat16")
    reference = train(_gpt(None, "llama"), _batches("llama"))
    keras.utils.clear_session()
    keras.config.set_dtype_policy("mixed_bfloat16")
    split = train(_gpt("seq=4,data=2", "llama", "ring"), _batches("llama"))
    np.testing.assert_allclose(split, reference, rtol=2e-4)
    assert reference[0] - reference[2] > 0.05  # the steps did change the loss


def _bert(mesh, variant="all_gather"):
    keras.distribution.set_distribution(
        kdist.distribution(mesh, context_parallel=variant) if mesh else None)
    keras.utils.set_random_seed(3)
    return BertMaskedLM(BertBackbone(**TINY_BERT))


@pytest.fixture(scope="module")
def bert_reference():
    model = _bert(None)
    batches = mlm_batches(3)  # rows of 8 to 16 real tokens of 16: padding masks
    out = batches, train_mlm(model, batches), weights(model)
    keras.utils.clear_session()
    return out


@pytest.mark.parametrize("variant", ["all_gather", "ring"])
def test_bert_with_padding(variant, bert_reference):
    batches, ref_losses, ref_weights = bert_reference
    split = _bert("seq=4,data=2", variant)
    np.testing.assert_allclose(train_mlm(split, batches), ref_losses, rtol=2e-6, atol=0)
    for path, value in weights(split).items():
        np.testing.assert_allclose(value, ref_weights[path], rtol=0, atol=2e-6, err_msg=path)


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
    # seq with stage or replica is refused until the combination is built and tested.
    for spec, options in (("seq=2,stage=2,fsdp=2", {}),
                          ("seq=2,replica=2,fsdp=2", {"sync_every": 10})):
        with pytest.raises(ValueError, match="'seq' axis has not been built or tested"):
            kdist.distribution(spec, **options)

    class Unsplit(GPTCausalLM):  # a task whose attention knows nothing of the split
        step_features = frozenset({"fused_loss"})

    keras.distribution.set_distribution(kdist.distribution("seq=8"))
    model = Unsplit(GPTBackbone(**TINY_GPT))
    with pytest.raises(ValueError, match="does not declare the 'context_parallel'"):
        model.compile(optimizer="adamw")
    keras.distribution.set_distribution(kdist.distribution("seq=2,model=4"))
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 .* 'model' size among \[1, 2\]"):
        GPTBackbone(**{**TINY_LLAMA, "num_key_value_heads": 2})
