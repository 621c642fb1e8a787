"""Loading and exporting with two processes on 127.0.0.1 (4 host devices each): each
process reads only the shards its devices hold, and the export gathers across processes;
with a stacked model under ``stage=2``, each process (one stage) reads only its own layer."""

import json
import os
import sys
from pathlib import Path

import pytest

from kdist import launch
from tests.models.hf_fixtures import write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "models" / "hf_multihost_script.py")


@pytest.mark.slow
def test_two_processes_read_their_own_halves_and_export_together(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH",
                                                                                "")]))
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    source = write_checkpoint(tmp_path / "source", "gpt2")
    status = launch.launch([sys.executable, SCRIPT, "--mesh", "fsdp=8", "--source",
                            str(tmp_path / "source"), "--out", str(tmp_path)],
                           processes=2, devices_per_process=4)
    assert status == 0
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["local_devices"] == 4 and rank["worst_shard_error"] == 0.0
        # fsdp=8 over two processes: each holds (and reads) half of every tensor.
        assert rank["bytes_read"] == rank["checkpoint_bytes"] // 2
    from safetensors.numpy import load_file

    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert set(exported) == set(source)
    for key, value in source.items():
        assert exported[key].tobytes() == value.tobytes(), key


@pytest.mark.slow
def test_two_pipeline_stages_read_their_own_layers_and_export_together(tmp_path, monkeypatch):
    # stage=2 over two processes: each process is one stage and holds one of the 2 layers.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH",
                                                                                "")]))
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    source = write_checkpoint(tmp_path / "source", "gpt2")
    status = launch.launch([sys.executable, SCRIPT, "--mesh", "stage=2,fsdp=4", "--scan-layers",
                            "--source", str(tmp_path / "source"), "--out", str(tmp_path)],
                           processes=2, devices_per_process=4)
    assert status == 0
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    layers = []
    for rank in ranks:
        assert rank["worst_shard_error"] == 0.0
        read = {int(k.split(".")[2]) for k in rank["tensors_read"] if ".h." in k}
        assert len(read) == 1  # its own layer's tensors only, each read whole (fsdp inside)
        layers += read
        for name, nbytes in rank["tensors_read"].items():
            if ".h." in name:
                assert nbytes == source[name].nbytes, name
    assert sorted(layers) == [0, 1]
    from safetensors.numpy import load_file

    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert set(exported) == set(source)
    for key, value in source.items():
        assert exported[key].tobytes() == value.tobytes(), key
