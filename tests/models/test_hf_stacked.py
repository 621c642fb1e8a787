"""Hugging Face checkpoints into and out of stacked (``scan_layers=True``) models.

A stacked model loaded from an HF directory holds exactly the weights of the unstacked
model loaded from it (converted with :mod:`kdist.models.stacking`), on 1 device and under
pipeline meshes (``(L, ...)`` stacks and ``(R, L / R, ...)`` with circular repeats); each
stored tensor is read once in all, each device reading only its own layers' boxes; export
writes per-layer HF tensors that reload bit for bit.
"""

import contextlib
import json

import keras
import numpy as np
import pytest
from safetensors.numpy import load_file

import kdist
from kdist.models import BertBackbone, GPTCausalLM, stacking
from kdist.models.hf import checkpoint, gpt2, stacked
from kdist.parallel import pipeline
from tests.models.hf_fixtures import write_checkpoint

LAYERS = {"gpt2": {"n_layer": 4}, "llama": {"num_hidden_layers": 4}, "bert": {}}  # bert: 2
IDS = np.random.default_rng(1).integers(0, 300, (8, 16)).astype("int32")  # 8: microbatches
BERT_X = {"token_ids": IDS, "segment_ids": (np.arange(16) >= 8).astype("int32")[None]
          .repeat(8, 0), "padding_mask": np.ones_like(IDS)}
PIPELINE_REPEATS = ("stage=2,fsdp=4", {"pipeline_repeats": 2})  # 2 x 2 stages of 1 layer


def _class(family):
    return BertBackbone if family == "bert" else GPTCausalLM


def _output(model, family):
    if family == "bert":
        return np.asarray(model.predict_on_batch(BERT_X)["sequence_output"])
    return np.asarray(model.predict_on_batch(IDS))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-stacked")
    return {family: (root / family, write_checkpoint(root / family, family, **layers))
            for family, layers in LAYERS.items()}


@pytest.fixture(scope="module")
def unstacked(checkpoints):
    """Per family: the unstacked model's weights and output on 1 device."""
    out = {}
    for family, (directory, _) in checkpoints.items():
        keras.distribution.set_distribution(None)
        model = _class(family).from_pretrained(directory, dropout=0.0, scan_layers=False)
        out[family] = ({w.path: np.asarray(w.value) for w in model.weights},
                       _output(model, family))
        keras.utils.clear_session()
    return out


@contextlib.contextmanager
def counting_reads(monkeypatch):
    """``{stored tensor name: elements read}`` of every box the loader copies out."""
    counts: dict[str, int] = {}
    original = checkpoint.HFCheckpoint.opened

    @contextlib.contextmanager
    def opened(self, name):
        with original(self, name) as reader:
            def read(box):
                values = reader(box)
                counts[name] = counts.get(name, 0) + values.size
                return values
            yield read

    monkeypatch.setattr(checkpoint.HFCheckpoint, "opened", opened)
    yield counts


def _load_stacked(family, directory, mesh, options, monkeypatch):
    keras.distribution.set_distribution(kdist.distribution(mesh, **options) if mesh else None)
    with counting_reads(monkeypatch) as counts:
        model = _class(family).from_pretrained(directory, dropout=0.0, scan_layers=True)
    return model, counts


def _assert_same_weights(model, reference):
    """Bit-exact against the unstacked weights, stacked into this model's layout."""
    want = stacking.match_layer_layout(reference, {w.path: tuple(w.shape)
                                                   for w in model.weights})
    stacks = [w for w in model.weights if stacking.unstacked_key(w.path, 0)]
    assert stacks and len(want) == len(model.weights)
    for w in model.weights:
        got = np.asarray(w.value)
        assert got.tobytes() == np.asarray(want[w.path]).tobytes(), w.path
    return stacks


@pytest.mark.parametrize("family, mesh, options", [
    ("gpt2", None, {}),
    ("gpt2", "stage=2,fsdp=2,model=2", {}),
    ("gpt2", *PIPELINE_REPEATS),
    ("llama", None, {}),
    ("llama", *PIPELINE_REPEATS),
    ("bert", "stage=2,data=4", {}),
])
def test_stacked_model_loads_the_unstacked_models_weights(family, mesh, options, checkpoints,
                                                          unstacked, monkeypatch):
    directory, source = checkpoints[family]
    model, counts = _load_stacked(family, directory, mesh, options, monkeypatch)
    stacks = _assert_same_weights(model, unstacked[family][0])
    # Every stored tensor the model takes is read once in all: each box of each layer by
    # the one shard that holds it (a replicated box once), never a whole stack per device.
    assert set(counts) == {k for k in source if not k.startswith("cls.")}  # bert: no MLM head
    for name, count in counts.items():
        assert count == source[name].size, name
    repeats = options.get("pipeline_repeats", 1)
    num_layers = 2 if family == "bert" else 4
    assert tuple(stacks[0].shape[:2]) == ((2, 2) if repeats > 1 else (num_layers, 64))
    got, want = _output(model, family), unstacked[family][1]
    if mesh is None:  # the same program on the same weights: the same bits
        np.testing.assert_array_equal(got, want)
        return
    assert "stage" in tuple(stacks[0].value.sharding.spec)
    assert pipeline.schedule_for(IDS.shape[0], 4, training=False) is not None  # pipelined
    # Only the summation order differs from one device (sharded matmuls, microbatches):
    # float32 rounding of logits up to ~7, observed <= 1.6e-5.
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-5)


def test_each_device_reads_only_its_own_layers_boxes(checkpoints):
    directory, source = checkpoints["gpt2"]
    mesh, options = PIPELINE_REPEATS
    keras.distribution.set_distribution(kdist.distribution(mesh, **options))
    lm = GPTCausalLM.from_pretrained(directory, dropout=0.0)  # stacked by default
    assert lm.backbone.scan_layers
    config = lm.backbone.full_config(lm.backbone.get_config())
    query = next(w for w in lm.weights if w.path == "blocks/attention/query/kernel")
    tensor_map = stacked.fitted(gpt2.tensor_map(query.path, config), query.shape)
    assert isinstance(tensor_map, stacked.StackedMap) and tensor_map.lead == (2, 2)
    mesh = query.value.sharding.mesh  # the jax mesh: each device's stage coordinate
    stage_of = {d: int(np.argwhere(mesh.devices == d)[0][mesh.axis_names.index("stage")])
                for d in mesh.devices.flat}
    for device, index in query.value.sharding.devices_indices_map(tuple(query.shape)).items():
        reads = []

        def reader(key, box, reads=reads):
            reads.append((key, int(np.prod([s.stop - s.start for s in box]))))
            return source[key][box]

        shard = tensor_map.read(reader, index)
        # Circular repeats: stage s holds layer s of each repeat, i.e. layers s and s + 2.
        s = stage_of[device]
        assert sorted({k for k, _ in reads}) == [f"transformer.h.{i}.attn.c_attn.weight"
                                                 for i in (s, s + 2)]
        assert sum(n for _, n in reads) == shard.size  # only the shard's own box
        np.testing.assert_array_equal(shard, np.asarray(query.value)[index])


def test_stacked_export_writes_per_layer_tensors_and_reloads_unstacked(
        checkpoints, unstacked, tmp_path):
    directory, source = checkpoints["gpt2"]
    mesh, options = PIPELINE_REPEATS
    keras.distribution.set_distribution(kdist.distribution(mesh, **options))
    lm = GPTCausalLM.from_pretrained(directory, dropout=0.0, scan_layers=True)
    lm.save_pretrained(tmp_path, max_shard_bytes=64 * 1024)
    out = {}
    for file in sorted(tmp_path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    assert set(out) == set(source)  # transformer.h.<i>... per layer, nothing stacked
    for key, value in source.items():
        assert out[key].tobytes() == value.tobytes(), key
    keras.distribution.set_distribution(None)
    again = GPTCausalLM.from_pretrained(tmp_path, dropout=0.0, scan_layers=False)
    for w in again.weights:
        assert np.asarray(w.value).tobytes() == unstacked["gpt2"][0][w.path].tobytes(), w.path
    # Written layer by layer (h.0's tensors, then h.1's ...), as an unstacked model's are.
    written = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    layers = [int(k.split(".")[2]) for k in written if k.startswith("transformer.h.")]
    assert layers == sorted(layers) and len(set(layers)) == 4


def test_a_stacked_model_names_each_bad_layer_tensor_before_reading(checkpoints, tmp_path,
                                                                   monkeypatch):
    _, tensors = checkpoints["gpt2"]
    bad = dict(tensors)
    del bad["transformer.h.3.mlp.c_fc.bias"]
    bad["transformer.h.2.attn.c_proj.weight"] = np.zeros((64, 32), "float32")
    write_checkpoint(tmp_path, "gpt2", tensors=bad, **LAYERS["gpt2"])
    keras.distribution.set_distribution(kdist.distribution(*PIPELINE_REPEATS[:1],
                                                           **PIPELINE_REPEATS[1]))
    with counting_reads(monkeypatch) as counts, pytest.raises(ValueError) as error:
        GPTCausalLM.from_pretrained(tmp_path)
    message = str(error.value)
    assert "tensor 'transformer.h.3.mlp.c_fc.bias' (256,) (for 'blocks/mlp/up/bias') is " \
           "missing" in message
    assert "tensor 'transformer.h.2.attn.c_proj.weight' has shape (64, 32) in the checkpoint " \
           "but this model needs (64, 64) (for 'blocks/attention/attention_output/kernel' " \
           "(2, 2, 4, 16, 64))" in message
    assert not counts  # refused before a value was read
    with pytest.raises(ValueError, match="has no gpt2 tensor .* fused_qkv=True"):
        GPTCausalLM.from_pretrained(checkpoints["gpt2"][0], fused_qkv=True)  # still refused


@pytest.mark.slow  # a pipelined training step compiles: ~29 s on 2 busy cores
def test_hf_weights_fine_tune_under_a_pipeline(checkpoints):
    # The user's path: a stage mesh, the model stacked by default, the checkpoint's dropout.
    keras.distribution.set_distribution(kdist.distribution("stage=2,fsdp=4"))
    lm = GPTCausalLM.from_pretrained(checkpoints["gpt2"][0])
    assert lm.backbone.scan_layers and lm.backbone.dropout == 0.1
    lm.compile(optimizer=kdist.optim.adamw(1e-3, warmup_steps=1, decay_steps=4))
    x = np.random.default_rng(0).integers(0, 300, (8, 17)).astype("int32")
    losses = [float(lm.train_on_batch(x[:, :-1], x[:, 1:])) for _ in range(3)]
    assert np.isfinite(losses).all() and losses[2] < losses[0]
