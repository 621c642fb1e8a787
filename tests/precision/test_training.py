"""The matmul precision policy in the models: the projections it quantizes, the config
round-trip, refusals, and a tiny GPT that trains under int8 and fp8 like the unquantized one
within a measured margin."""

import keras
import numpy as np
import pytest

import kdist
from kdist.models import BertBackbone, GPTBackbone
from kdist.precision import QuantizedDense, QuantizedEinsumDense
from tests.bert_helpers import TINY_BERT
from tests.helpers import TINY_GPT, TINY_LLAMA, tiny_gpt, token_batches, train

# Relative gap of each step's loss to the unquantized run's (float32 policy, tiny GPT, 6
# steps of lr 1e-2): measured <= 6.3e-5 (int8), 1.7e-5 (int8-sr: one draw of its noise,
# int8's bound) and <= 1.3e-4 (fp8; e4m3 keeps 3 mantissa bits where int8 keeps ~7 at a
# slice's peak). The bounds are ~8x those and still 1/40 of the 0.23 (4 %) the loss falls
# over the 6 steps, so a policy that broke training (a lost gradient, a wrong scale)
# cannot pass.
STEP_LOSS_RTOL = {"int8": 5e-4, "int8-sr": 5e-4, "fp8": 1e-3}


def _projections(model):
    return [layer for layer in model._flatten_layers() if isinstance(
        layer, (keras.layers.Dense, keras.layers.EinsumDense))]


@pytest.mark.parametrize("config", [TINY_GPT, {**TINY_LLAMA, "fused_qkv": True}],
                         ids=["gpt", "llama-fused-qkv"])
def test_every_block_projection_is_quantized_and_nothing_else(config):
    model = GPTBackbone(**config, matmul_precision="int8")
    quantized = {layer.path.split("/", 1)[1] for layer in _projections(model)
                 if isinstance(layer, (QuantizedDense, QuantizedEinsumDense))}
    names = {"attention/qkv"} if config.get("fused_qkv") else {
        "attention/query", "attention/key", "attention/value"}
    names |= {"attention/attention_output", "mlp/up", "mlp/down"}
    names |= {"mlp/gate"} if config.get("mlp_activation") == "swiglu" else set()
    assert quantized == {f"{name}" for name in names}, quantized
    plain = GPTBackbone(**config)
    assert [w.path for w in model.weights] == [w.path for w in plain.weights]  # checkpoints
    assert all(str(w.dtype) == "float32" for w in model.weights)  # master weights


def test_matmul_precision_round_trips_through_get_config():
    for name in ("fp8", "int8-sr"):
        gpt = GPTBackbone(**TINY_GPT, matmul_precision=name)
        again = GPTBackbone.from_config(gpt.get_config())
        assert again.matmul_precision == name
        up = again.get_layer("block_0").mlp.up
        assert isinstance(up, QuantizedDense) and up.matmul_precision == name
    bert = BertBackbone(**TINY_BERT, matmul_precision="int8")
    assert BertBackbone.from_config(bert.get_config()).matmul_precision == "int8"
    assert kdist.precision("int8").quantized and not kdist.precision().quantized


@pytest.mark.parametrize("build", [
    lambda: GPTBackbone(**TINY_GPT, matmul_precision="int4"),
    lambda: BertBackbone(**TINY_BERT, matmul_precision="float8"),
    lambda: kdist.precision("int4"),
    lambda: QuantizedDense(4, matmul_precision="bf16"),
    lambda: QuantizedEinsumDense("btd,dn->btn,x", (None, 4)),
])
def test_wrong_precisions_and_equations_are_refused_with_the_fix(build):
    with pytest.raises(ValueError, match="'bf16'"):
        build()


@pytest.mark.parametrize("precision", ["int8", "int8-sr", "fp8"])
def test_tiny_gpt_trains_like_the_unquantized_model(precision):
    batches = token_batches(6)
    plain = train(tiny_gpt(seed=1), batches)
    quantized = train(tiny_gpt(seed=1, matmul_precision=precision), batches)
    assert quantized != plain  # it really quantized
    np.testing.assert_allclose(quantized, plain, rtol=STEP_LOSS_RTOL[precision])
    assert quantized[0] - quantized[-1] > 0.2  # and learned (unquantized: 0.228)
