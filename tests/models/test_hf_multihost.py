"""Loading and exporting with two processes on 127.0.0.1 (4 host devices each): each
process reads only the shards its devices hold, and the export gathers across processes;
with a stacked model under ``stage=2``, each process (one stage) reads only its own layer.
(tests/multihost_script.py's ``hf`` cases, run by tests/conftest.py's ``multihost_cases``.)"""

import pytest
from safetensors.numpy import load_file


def _source(multihost_cases):
    return load_file(str(multihost_cases.root / "hf-source" / "model.safetensors"))


def _assert_export_is_the_source(multihost_cases, name):
    source = _source(multihost_cases)
    exported = load_file(str(multihost_cases.out(name) / "export" / "model.safetensors"))
    assert set(exported) == set(source)
    for key, value in source.items():
        assert exported[key].tobytes() == value.tobytes(), key


@pytest.mark.slow
@pytest.mark.xdist_group("multihost")  # one worker launches the processes once
def test_two_processes_read_their_own_halves_and_export_together(multihost_cases):
    for rank in multihost_cases.ranks("hf fsdp=8"):
        assert rank["local_devices"] == 4 and rank["worst_shard_error"] == 0.0
        # fsdp=8 over two processes: each holds (and reads) half of every tensor.
        assert rank["bytes_read"] == rank["checkpoint_bytes"] // 2
    _assert_export_is_the_source(multihost_cases, "hf fsdp=8")


@pytest.mark.slow
@pytest.mark.xdist_group("multihost")  # one worker launches the processes once
def test_two_pipeline_stages_read_their_own_layers_and_export_together(multihost_cases):
    # stage=2 over two processes: each process is one stage and holds one of the 2 layers.
    source = _source(multihost_cases)
    layers = []
    for rank in multihost_cases.ranks("hf stage=2,fsdp=4"):
        assert rank["worst_shard_error"] == 0.0
        read = {int(k.split(".")[2]) for k in rank["tensors_read"] if ".h." in k}
        assert len(read) == 1  # its own layer's tensors only, each read whole (fsdp inside)
        layers += read
        for name, nbytes in rank["tensors_read"].items():
            if ".h." in name:
                assert nbytes == source[name].nbytes, name
    assert sorted(layers) == [0, 1]
    _assert_export_is_the_source(multihost_cases, "hf stage=2,fsdp=4")
