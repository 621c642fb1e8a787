"""Attention implementations inside the models: splash and kdist's flash kernels
(interpreted on the CPU) train a GPT exactly like XLA's attention, also sharded and with
documents; ``"auto"`` picks by device; what an implementation cannot do is refused by name
before anything compiles."""

import keras
import numpy as np
import pytest

import kdist
from kdist import accelerators
from kdist.models import GPTBackbone, GPTCausalLM
from tests.bert_helpers import mlm_batches, tiny_bert_mlm, train_mlm
from tests.helpers import TINY_GPT, TINY_LLAMA, token_batches, train

T = 128  # the Pallas kernels tile whole multiples of 128 tokens
KERNELS = ["splash", "flash"]
BATCHES = token_batches(3, length=T)


def _lm(config, implementation, mesh=None, seed=0, **overrides):
    keras.distribution.set_distribution(kdist.distribution(mesh) if mesh else None)
    keras.utils.set_random_seed(seed)
    return GPTCausalLM(GPTBackbone(**{**config, "max_sequence_length": T, **overrides},
                                   attention_implementation=implementation))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("config", [TINY_GPT, TINY_LLAMA], ids=["gpt", "llama-gqa-rope"])
def test_kernel_trains_like_xla_attention(kernel, config):
    np.testing.assert_allclose(train(_lm(config, kernel), BATCHES),
                               train(_lm(config, "xla"), BATCHES), rtol=2e-6)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_keeps_documents_apart_like_xla_attention(kernel):
    segments = np.repeat(np.arange(4), T // 4)[None].repeat(8, 0)  # 4 documents per row
    batches = [({"token_ids": x, "segment_ids": segments}, y) for x, y in BATCHES]
    np.testing.assert_allclose(
        train(_lm(TINY_GPT, kernel, document_mask=True), batches),
        train(_lm(TINY_GPT, "xla", document_mask=True), batches), rtol=2e-6)


@pytest.mark.parametrize("kernel", KERNELS)
def test_sharded_kernel_trains_like_one_device(kernel):
    one = train(_lm(TINY_LLAMA, kernel, seed=2), BATCHES)
    sharded = train(_lm(TINY_LLAMA, kernel, "data=2,fsdp=2,model=2", seed=2), BATCHES)
    np.testing.assert_allclose(sharded, one, rtol=2e-6)


def test_auto_picks_by_device_and_shape():
    lm = _lm(TINY_GPT, "auto")
    layer = lm.backbone.blocks[0].attention
    assert layer.implementation(T, T, arbitrary_mask=False) == "xla"  # a CPU
    with accelerators.assume("TPU v5 lite"):
        assert layer.implementation(T, T, arbitrary_mask=False) == "flash"
        # an example's keys beyond what flash holds in VMEM: splash
        assert layer.implementation(2**18, 2**18, arbitrary_mask=False) == "splash"
        assert layer.implementation(100, 100, arbitrary_mask=False) == "xla"  # not 128k
        assert layer.implementation(T, T, arbitrary_mask=True) == "xla"  # padded keys
    chunked = _lm(TINY_GPT, "auto", attention_chunk_size=32).backbone.blocks[0].attention
    assert chunked.implementation(T, T, arbitrary_mask=False) == "chunked"


@pytest.mark.parametrize("kernel", KERNELS)
def test_what_a_kernel_cannot_take_is_refused_by_name(kernel):
    with pytest.raises(ValueError, match=f"attention_implementation='{kernel}' cannot take a "
                                         "mask other than causality"):
        train_mlm(tiny_bert_mlm(attention_implementation=kernel), mlm_batches(1))
    with pytest.raises(ValueError, match=f"attention_implementation='{kernel}' does not split"):
        lm = _lm(TINY_GPT, kernel, "seq=2,data=4")
        train(lm, BATCHES[:1])
    with pytest.raises(ValueError, match="per-device region"):
        keras.distribution.set_distribution(
            kdist.distribution("data=8", gradient_reduction="float32"))
        keras.utils.set_random_seed(0)
        lm = GPTCausalLM(GPTBackbone(**{**TINY_GPT, "max_sequence_length": T},
                                     attention_implementation=kernel))
        train(lm, BATCHES[:1])
