"""`kdist inspect` on a real checkpoint directory: listing, integrity, damage."""

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
