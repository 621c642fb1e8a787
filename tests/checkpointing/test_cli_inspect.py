"""`kdist inspect` on a real checkpoint directory: listing, integrity, damage."""

import hashlib
import shutil

from kdist import cli
from tests.checkpointing.test_checkpoint import run


def test_inspect_lists_verifies_and_reports_damage(tmp_path, capsys):
    model = run(tmp_path, epochs=1, save_every_steps=2)[0]  # steps 2 and 4
    (tmp_path / "6.orbax-checkpoint-tmp").mkdir()  # what a killed save leaves
    assert cli.main(["inspect", str(tmp_path), "--read"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert [line.split()[0] for line in lines if line.strip().endswith("ok")] == ["2", "4"]
    assert "partial save 6.orbax-checkpoint-tmp" in out
    assert "newest intact: step 4, data position 4" in out
    assert '"num_layers": 2' in out and "GPTCausalLM" in out
    assert f"parameters: {model.count_params():,}" in out

    damaged = max((f for f in (tmp_path / "4").rglob("*") if f.is_file()),
                  key=lambda f: f.stat().st_size)
    damaged.write_bytes(damaged.read_bytes()[:10])
    assert cli.main(["inspect", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and damaged.name in out and "newest intact: step 2" in out


def test_inspect_explains_a_missing_directory(tmp_path, capsys):
    assert cli.main(["inspect", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_inspect_of_a_run_directory_finds_its_checkpoints(tmp_path, capsys):
    """`kdist inspect RUN_DIR` said "no checkpoints" with exit status 0; they were in
    RUN_DIR/checkpoints."""
    (tmp_path / "tensorboard" / "train").mkdir(parents=True)  # beside them, as in a run
    assert cli.main(["inspect", str(tmp_path)]) == 2
    assert f"No checkpoints in {tmp_path}, nor in the directories below it" in (
        capsys.readouterr().err)
    run(tmp_path / "group-0" / "checkpoints", epochs=1, save_every_steps=2)  # steps 2, 4
    shutil.copytree(tmp_path / "group-0", tmp_path / "group-1")  # separate group jobs'
    assert cli.main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{tmp_path} holds no checkpoints itself; found below it: "
                          f"group-0/checkpoints, group-1/checkpoints\n")
    assert out.count("checkpoint directory") == 2 and "newest intact: step 4" in out


def test_a_relative_path_reads_back_and_lists_what_was_verified(tmp_path, capsys,
                                                                monkeypatch):
    """`kdist inspect DIR --read` with DIR relative reported every step DAMAGED (orbax reads
    absolute paths only), and a user may then delete good checkpoints."""
    run(tmp_path / "ckpt", epochs=1, save_every_steps=2)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["inspect", "ckpt", "--read"]) == 0
    out = capsys.readouterr().out
    assert "DAMAGED" not in out
    for step in ("2", "4"):
        files = [f for f in sorted((tmp_path / "ckpt" / step / "default").rglob("*"))
                 if f.is_file()]
        for f in files:
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            assert f"{f.relative_to(tmp_path / 'ckpt' / step)}  {f.stat().st_size:,} bytes  " \
                   f"sha256 {digest} verified" in out
