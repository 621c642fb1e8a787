"""kdist's orbax writer: in one process a replicated array is written by one replica, not
sliced into parts on the devices first (kdist/orbax_writer.py)."""

import jax
import numpy as np
import orbax.checkpoint as ocp

from kdist import orbax_writer as writer


def test_one_process_writes_a_replicated_array_without_slicing_it(tmp_path, monkeypatch):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    # 256 x 128 float32: a shape orbax would split across the 8 replicas (its size a multiple
    # of 1024, its last axis of 128), each part an eager slice compiled for its device.
    tree = {"w": jax.device_put(np.arange(256 * 128, dtype=np.float32).reshape(256, 128),
                                replicated)}
    slices = []
    slice_in_dim = jax.lax.slice_in_dim
    monkeypatch.setattr(jax.lax, "slice_in_dim",
                        lambda *a, **k: slices.append(k) or slice_in_dim(*a, **k))

    with ocp.PyTreeCheckpointer() as default:  # orbax's own choice: replica-parallel
        default.save(tmp_path / "default", args=ocp.args.PyTreeSave(tree))
    assert len(slices) == 8, slices  # the check sees the slicing it rules out below
    slices.clear()
    with writer.checkpointer() as checkpointer:
        checkpointer.save(tmp_path / "kdist", args=ocp.args.PyTreeSave(tree))
    assert slices == []

    with ocp.PyTreeCheckpointer() as reader:  # read back with orbax's defaults, as kdist does
        target = {"w": jax.ShapeDtypeStruct((256, 128), np.float32, sharding=replicated)}
        for name in ("default", "kdist"):
            got = reader.restore(tmp_path / name, args=ocp.args.PyTreeRestore(
                target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
            np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(tree["w"]))
