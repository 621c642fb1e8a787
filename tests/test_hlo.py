"""Collectives read from optimized HLO text."""
# ruff: noqa: E501  (HLO lines below as XLA prints them)

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kdist.hlo import parse_collectives, shape_bytes, summarize_collectives

HLO = """
  %all-gather.2 = f32[768,12,64]{2,1,0} all-gather(%param.154), channel_id=3, replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, dimensions={0}
  %all-reduce.3 = (f32[], bf16[1024]{0}) all-reduce(%a, %b), channel_id=4, replica_groups=[4,2]<=[8], to_apply=%add
  %reduce-scatter.1 = f32[16,8]{1,0} reduce-scatter(%g), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  ROOT %ags = (f32[2]{0}, f32[8]{0}) all-gather-start(%p), replica_groups=[1,4]<=[4], dimensions={0}
  %agd = f32[8]{0} all-gather-done(%ags)
  %cp = f32[100]{0} collective-permute(%x), source_target_pairs={{0,1},{1,0}}
  %add.1 = f32[10]{0} add(%all-reduce.3, %y)
"""


def test_parse_every_form_of_replica_groups_and_async_pairs():
    found = {c.name: c for c in parse_collectives(HLO)}
    assert sorted(found) == ["ags", "all-gather.2", "all-reduce.3", "cp", "reduce-scatter.1"]
    ag = found["all-gather.2"]
    assert (ag.kind, ag.bytes, ag.group_size) == ("all-gather", 768 * 12 * 64 * 4, 8)
    assert ag.wire_bytes == pytest.approx(7 / 8 * ag.bytes)
    ar = found["all-reduce.3"]  # a tuple all-reduce: the sum of its arrays, groups of 2
    assert (ar.bytes, ar.group_size, ar.wire_bytes) == (4 + 2048, 2, 2048 + 4)
    rs = found["reduce-scatter.1"]  # result is one of 4 shards: logical size is 4x
    assert (rs.bytes, rs.group_size) == (16 * 8 * 4 * 4, 4)
    assert found["ags"].bytes == 32  # the result half of the async start's tuple
    assert found["cp"].wire_bytes == 400
    summary = summarize_collectives(found.values())
    assert summary["all-gather"]["count"] == 2
    assert summary["all-gather"]["bytes"] == ag.bytes + 32
    assert list(summary) == ["all-reduce", "all-gather", "reduce-scatter", "collective-permute"]
    assert shape_bytes("(pred[3]{0}, s8[2])") == [3, 2]


def test_real_program_gather_and_reduce():
    """A sharded matmul whose result is replicated: XLA must gather or reduce; the bytes
    follow from the shapes."""
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("x",))
    x_sharding = NamedSharding(mesh, PartitionSpec("x", None))
    replicated = NamedSharding(mesh, PartitionSpec())

    @jax.jit
    def f(x, w):
        gathered = jax.lax.with_sharding_constraint(x, replicated)  # all-gather of 64x32 f32
        return gathered @ w, jnp.sum(x)  # the sum of a sharded x: all-reduce of a scalar

    x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=x_sharding)
    w = jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=replicated)
    text = f.lower(x, w).compile().as_text()
    summary = summarize_collectives(parse_collectives(text, num_devices=8))
    assert summary["all-gather"]["bytes"] == 64 * 32 * 4
    assert summary["all-gather"]["wire_bytes"] == pytest.approx(7 / 8 * 64 * 32 * 4)
    assert summary["all-reduce"]["count"] >= 1


def test_collectives_in_a_loop_count_once_per_iteration():
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("x",))
    ring = [(i, (i + 1) % 8) for i in range(8)]

    def f(x):  # 7 steps of a ring, then one more transfer outside the loop
        x, _ = jax.lax.scan(lambda c, _: (jax.lax.ppermute(c, "x", ring) * 2, None), x,
                            None, length=7)
        return jax.lax.ppermute(x, "x", ring)

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=PartitionSpec("x"),
                              out_specs=PartitionSpec("x")))
    found = parse_collectives(g.lower(jnp.ones(64)).compile().as_text(), 8)
    assert sorted(c.executions for c in found) == [1, 7]
    assert summarize_collectives(found)["collective-permute"] == {
        "count": 8, "bytes": 8 * 32.0, "wire_bytes": 8 * 32.0}
