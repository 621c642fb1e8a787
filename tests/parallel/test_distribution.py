"""Mesh specs, layouts and the checks that run before anything compiles."""

import jax
import keras
import numpy as np
import pytest

import kdist
from kdist.models import GPTBackbone
from kdist.parallel.config import Parallelism
from kdist.parallel.layout import BatchLayout
from kdist.parallel.mesh import MESH_AXES, REPLICA_AXES, full_mesh, parse_mesh
from tests.helpers import TINY_GPT, tiny_gpt


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("fsdp=8", (1, 8, 1)),
        ("data=2,model=4", (2, 1, 4)),
        ("data=2,fsdp=2,model=2", (2, 2, 2)),
        ("model=2,fsdp=-1", (1, 4, 2)),
        ("auto", (1, 8, 1)),
        ("dp", (8, 1, 1)),
        ("tp", (1, 1, 8)),
        (" Data = 8 ", (8, 1, 1)),
    ],
)
def test_parse_mesh(spec, expected):
    sizes = parse_mesh(spec, 8)
    assert list(sizes) == list(MESH_AXES)  # every axis, in registry order
    assert (sizes["data"], sizes["fsdp"], sizes["model"]) == expected
    assert sizes["replica"] == sizes["stage"] == sizes["seq"] == 1


@pytest.mark.parametrize("axis", [a for a in MESH_AXES if a != "fsdp"])
def test_every_registered_axis_builds_a_distribution(axis):
    # Each axis has its transform (replica: DiLoCo, which needs its sync interval).
    options = {"sync_every": 10} if axis == "replica" else {}
    assert kdist.distribution(f"{axis}=2,fsdp=4", **options).mesh_shape[axis] == 2


@pytest.mark.parametrize(
    "spec, message",
    [
        ("fsdp=4", "describes 4 devices, but 8 are available"),
        ("fsdp=16", "describes 16 devices"),
        ("pipeline=8", "unknown axis 'pipeline'"),
        ("fsdp=-1,data=-1", "only one axis may be -1"),
        ("model=3,fsdp=-1", "does not divide"),
        ("fsdp=two", "must be an integer"),
        ("fsdp=0", "positive integer"),
        ("fsdp=4,fsdp=2", "given twice"),
        ("fsdp8", "not of the form"),
        ("", "non-empty"),
    ],
)
def test_bad_mesh_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_mesh(spec, 8)


def test_distribution_mesh_and_batch_layout():
    dist = kdist.distribution("data=2,fsdp=2,model=2")
    assert dist.mesh_shape == full_mesh({"data": 2, "fsdp": 2, "model": 2})
    assert dist.num_model_replicas == 4
    assert dist.spec == "data=2,fsdp=2,model=2"
    layout = dist.get_data_layout((16, 32))
    assert isinstance(layout, BatchLayout)
    sharding = layout.backend_layout
    assert tuple(sharding.spec) == (REPLICA_AXES, None)
    # The batch is split 4 ways over the replicas and replicated over `model`.
    x = jax.device_put(np.arange(16 * 32).reshape(16, 32), sharding)
    assert {s.data.shape for s in x.addressable_shards} == {(4, 32)}


def test_fsdp_bytes_per_device_are_an_eighth():
    model = tiny_gpt("fsdp=8", vocabulary_size=512, hidden_dim=128, intermediate_dim=512)
    model.compile(optimizer=kdist.optim.adamw())
    model.optimizer.build(model.trainable_variables)
    variables = model.weights + model.optimizer.variables
    total = sum(v.value.nbytes for v in variables)
    per_device = sum(v.value.addressable_shards[0].data.nbytes for v in variables)
    replicated = sum(v.value.nbytes for v in variables if v.value.sharding.is_fully_replicated)
    assert per_device <= total / 8 + replicated
    assert replicated < 0.02 * total  # only norms, biases over embed and counters
    assert per_device < total / 7


def test_large_weight_without_table_entry_is_refused():
    keras.distribution.set_distribution(kdist.distribution("fsdp=8"))
    layer = keras.layers.Dense(256, name="unlisted")
    with pytest.raises(ValueError, match="unlisted/kernel.*no logical axes.*silently replicated"):
        layer.build((None, 256))


def test_small_unlisted_weights_are_replicated():
    keras.distribution.set_distribution(kdist.distribution("fsdp=8"))
    layer = keras.layers.Dense(4, name="small")
    layer.build((None, 4))
    assert layer.kernel.value.sharding.is_fully_replicated


@pytest.mark.parametrize(
    "mesh, overrides, message",
    [
        ("model=8", dict(num_heads=4, hidden_dim=64), "num_heads=4 is not divisible by the"),
        ("model=8", dict(intermediate_dim=100), "intermediate_dim=100 is not divisible"),
        ("model=8", dict(vocabulary_size=250), "vocabulary_size=250 is not divisible"),
        ("fsdp=8", dict(hidden_dim=36, num_heads=4), "dimension 1 \\('embed', size 36\\)"),
    ],
)
def test_indivisible_shapes_fail_before_building(mesh, overrides, message):
    keras.distribution.set_distribution(kdist.distribution(mesh))
    with pytest.raises(ValueError, match=message):
        GPTBackbone(**{**TINY_GPT, **overrides})


def test_global_batch_must_divide_by_replicas():
    keras.distribution.set_distribution(kdist.distribution("data=2,fsdp=2,model=2"))
    with pytest.raises(ValueError, match="global_batch_size=6 is not divisible by the 4"):
        kdist.data.lm_dataset(global_batch_size=6, sequence_length=16)


def test_a_numpy_batch_the_replicas_cannot_split_is_named_before_compiling():
    keras.distribution.set_distribution(kdist.distribution("data=8"))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.zeros((24, 4), "float32"), np.zeros((24, 1), "float32")
    message = (r"A batch of 12 rows cannot be split over the batch axes \(data=8: 8 model "
               r"replicas.*multiple of 8, e.g. 8 or 16 \(model.fit's batch_size")
    with pytest.raises(ValueError, match=message):
        model.fit(x, y, batch_size=12, epochs=1, verbose=0)
    model.fit(x[:16], y[:16], batch_size=8, epochs=1, verbose=0)  # a multiple trains
    # A kdist model checks every batch size fit will send, the epoch's last one included
    # (Keras lays out the first batch only): 20 rows in batches of 8 end with 4.
    gpt = tiny_gpt("data=8")
    gpt.compile(optimizer="adamw")
    tokens = np.zeros((20, 16), "int32")
    with pytest.raises(ValueError, match=r"A batch of 4 rows .*multiple of 8, e.g. 8 \(.*the "
                                         r"last batch of an epoch holds the remaining samples"):
        gpt.fit(tokens, tokens, batch_size=8, epochs=1, verbose=0)




def test_a_model_built_before_its_distribution_is_refused_with_the_order_to_follow():
    model = tiny_gpt(None)  # built on one device, no distribution
    keras.distribution.set_distribution(kdist.distribution("data=8"))
    with pytest.raises(ValueError, match=r"GPTCausalLM's weights were created before the "
                       r"distribution 'data=8' was set \(under no distribution; the mesh spans "
                       r"8 devices\).*Set the distribution first"):
        model.compile(optimizer="adamw")
    tiny_gpt("data=8").compile(optimizer="adamw")  # in that order it compiles


@pytest.mark.parametrize("spec, settings", [
    ("stage=2,fsdp=4", dict(pipeline_microbatches=4, pipeline_schedule="1f1b")),
    ("replica=2,seq=2,data=2", dict(sync_every=5, context_parallel="ring", load_balance=False)),
    ("data=8", dict(gradient_reduction="int8", error_feedback=True)),
])
def test_a_parallelism_is_the_one_settings_object_there_and_back(spec, settings):
    """A distribution's config builds the same distribution again (kdist.distribution takes
    it, as it takes a plan's), and refuses keywords beside it rather than pick one."""
    config = kdist.distribution(spec, **settings).config
    assert kdist.distribution(config).config == config
    assert Parallelism.build(config.spec, 8, **config.settings) == config
    with pytest.raises(ValueError, match="also pipeline_repeats. Change the settings in one"):
        kdist.distribution(config, pipeline_repeats=2)
