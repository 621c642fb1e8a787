"""Rematerialisation chosen for the device: ``"auto"`` is no remat on a CPU and the least
recompute that fits elsewhere; a scanned stack keeps no more than the unrolled blocks."""

from unittest import mock

import keras
import pytest

import kdist
from kdist import accelerators
from kdist.models import GPTBackbone, GPTCausalLM, remat
from kdist.planning.compile import build_abstract, compile_train_step, token_batch
from tests.helpers import TINY_GPT


def test_auto_is_no_remat_on_a_cpu():
    lm = GPTCausalLM(GPTBackbone(**TINY_GPT))
    assert lm.backbone.remat == "auto"
    assert accelerators.remat_for(lm, 8, 16) is False
    with remat.choosing(accelerators.remat_for(lm, 8, 16)):
        assert remat.effective("auto") is False
        with remat.stacked():  # a scanned stack never keeps every intermediate
            assert remat.effective("auto") == "minimal"
    assert remat.effective("block") == "block"


@pytest.mark.parametrize("gib, want", [(40, False), (28, "save_dots"), (16, "block")])
def test_auto_takes_the_least_recompute_that_fits(gib, want):
    # gpt2-medium at batch 32 x 1024 on a TPU (bfloat16, kdist's flash kernel), past the
    # batch compiled for the chip (COMPILED_FITS: 16): the estimate decides. Its step needs
    # 26.6 GiB keeping everything (a TPU's XLA keeps "minimal"'s set then: the same), 23.6
    # with "save_dots", 12.7 with "block"; 90 % of the device's memory may be planned on.
    lm = build_abstract(lambda: GPTCausalLM.from_preset("gpt2-medium"), None)
    with accelerators.assume("TPU v5 lite"), \
            mock.patch.object(accelerators.defaults, "device_memory",
                              return_value=gib * 2**30):
        assert accelerators.remat_for(lm, 32, 1024) == want
        assert accelerators.remat_for(lm, 16, 1024) is False  # compiled for the chip: fits


def _temporaries(scan_layers, policy_in_scan=True):
    keras.utils.clear_session()
    config = dict(vocabulary_size=512, num_layers=4, num_heads=4, hidden_dim=128,
                  intermediate_dim=512, max_sequence_length=256, scan_layers=scan_layers)
    lm = build_abstract(lambda: GPTCausalLM(GPTBackbone(**config)), None)
    lm.compile(optimizer="adamw", loss=keras.losses.SparseCategoricalCrossentropy(True))
    keep_all = mock.patch.object(remat, "in_scan", lambda policy: policy)
    with keep_all if not policy_in_scan else mock.MagicMock():
        compiled, _ = compile_train_step(lm, *token_batch(8, 256), None)
    return compiled.memory_analysis().temp_size_in_bytes


def test_a_scanned_stack_needs_no_more_memory_than_the_unrolled_blocks():
    unrolled, scanned = _temporaries(False), _temporaries(True)
    # Measured on XLA:CPU: 214 MiB unrolled, 88 MiB scanned; a scan keeping every
    # intermediate of every layer (JAX's default for lax.scan): 247 MiB. On a TPU v5e,
    # gpt2-small at batch 16 x 1024 needed 15.1 GiB scanned that way against 4.5 unrolled.
    assert scanned <= unrolled, (scanned, unrolled)
    assert _temporaries(True, policy_in_scan=False) > unrolled


def test_default_batch_is_the_one_compiled_for_the_chip_or_the_estimates():
    lm = build_abstract(lambda: GPTCausalLM.from_preset("gpt2-medium"), None)
    assert accelerators.default_batch(lm, 1024) == 8  # a CPU: 8 per replica
    with accelerators.assume("TPU v5 lite"):
        # COMPILED_FITS: 16 fits, 8 is faster (measured on the chip)
        assert accelerators.default_batch(lm, 1024) == 8
        assert accelerators.default_batch(lm.cost_model(), 1024) == 8
        assert accelerators.remat_for(lm, 16, 1024) is False  # 16 fits without recompute
    other = build_abstract(lambda: GPTCausalLM.from_preset("gpt2-medium", num_layers=12),
                           None)
    memory = 16_909_336_064  # a v5e chip's, as JAX reports it
    with accelerators.assume("TPU v5 lite"), \
            mock.patch.object(accelerators.defaults, "device_memory", return_value=memory):
        batch = accelerators.default_batch(other, 1024)  # no entry: the estimate's
        cost = other.cost_model()
        assert accelerators.step_bytes(cost, {}, batch, 1024, False) <= 0.9 * memory
        assert accelerators.step_bytes(cost, {}, 2 * batch, 1024, False) > 0.9 * memory


def test_unknown_policies_are_refused_by_name():
    with pytest.raises(ValueError, match="minimal"):
        GPTBackbone(**TINY_GPT, remat="everything")
    with pytest.raises(ValueError, match="attention_implementation"):
        GPTBackbone(**TINY_GPT, attention_implementation="cudnn")
    assert kdist.accelerators.ATTENTION_IMPLEMENTATIONS[0] == "auto"
