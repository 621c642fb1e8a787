"""The README is an entry point that works as written: its Python and shell blocks run
(with a small step count from the environment — STEPS for the script, EXTRA_ARGS for
`make run` — never by editing the text), it maps docs/, and every path and module name the
README and docs/ mention exists."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, child_environment
from tests.xla_flags import for_run_time

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
# `make run`, shrunk: the README's own ARGS come first, these (Makefile: EXTRA_ARGS) win.
QUICK = ("--steps 4 --eval-every 2 --eval-steps 1 --global-batch-size 8 --sequence-length 64 "
         "--vocabulary-size 1024 --sample-length 4 --checkpoint-every 2 --log-every 2")
SKIPPED = {"make test"}  # this very suite
EXTENSIONS = {"py", "md", "json", "jsonl", "txt", "sh", "npy", "npz", "keras", "h5", "png",
              "safetensors"}


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def commands(block: str) -> list[str]:
    """The block's commands: comments dropped, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.split("  #")[0].split(" # ")[0].strip() for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_the_readme_is_an_entry_point_that_maps_the_docs():
    text = README.read_text()
    assert len(text.splitlines()) <= 220  # about 200 lines; the reference is in docs/
    two = text.split("## The two commands")[1].split("\n## ")[0]
    assert commands(blocks(two, "bash")[0]) == ["make run", "make test"]
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", text))
    assert linked == {f"docs/{p.name}" for p in DOCS}, "every docs/ page, and only those"
    assert "| `kdist/parallel/` |" not in text  # the package map lives in docs/architecture.md
    assert "| `kdist/parallel/` |" in (ROOT / "docs" / "architecture.md").read_text()
    assert len(blocks(text, "python")) == 1 and "import kdist" in blocks(text, "python")[0]


def test_every_path_and_module_name_mentioned_exists():
    """Stale lines such as `layout._NOT_BUILT`, `context.py` or tests that moved."""
    missing = []
    for page in [README, *DOCS]:
        text = page.read_text()
        for path in re.findall(r"`((?:kdist|tests|benchmarks|recipes|docs)/[\w./-]*)`", text):
            if not (ROOT / path).exists():
                missing.append(f"{page.name}: {path}")
        for module, name in re.findall(r"`(\w+)\.(_?[A-Za-z]\w*)`", text):
            if name in EXTENSIONS:
                continue
            sources = list((ROOT / "kdist").rglob(f"{module}.py"))
            if sources and not any(re.search(rf"\b{name}\b", s.read_text()) for s in sources):
                missing.append(f"{page.name}: {module}.{name}")
    assert not missing, missing


def test_make_help_lists_every_target_with_what_it_does():
    env = {k: v for k, v in child_environment().items() if k != "MAKEFLAGS"}
    done = subprocess.run(["make", "-s", "help"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    listed = dict(re.findall(r"^  make (\S+) +(.+)$", done.stdout, flags=re.M))
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    assert targets <= set(listed), (targets, listed)
    assert all(len(text) > 10 for text in listed.values())


def test_make_keeps_the_recipes_cache_in_the_project_for_clean_to_remove():
    """`make clean` left ~/.cache/kdist, where the recipes had cached their tokenizers."""
    env = {k: v for k, v in child_environment().items() if k not in ("MAKEFLAGS", "KDIST_CACHE")}
    done = subprocess.run(["make", "-n", "run", "bert-pretrain", "bert-finetune", "clean"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    recipes = [line for line in done.stdout.splitlines() if " recipes/" in line]
    assert len(recipes) == 3, done.stdout
    for line in recipes:  # the recipe's environment, as the shell gives it
        prefix = line.split(" .venv/bin/python")[0]
        cache = subprocess.run(["sh", "-c", f"{prefix} printenv KDIST_CACHE"], env=env,
                               capture_output=True, text=True, timeout=60).stdout.strip()
        assert cache and Path(cache).is_relative_to(ROOT / ".cache"), line
    assert "rm -rf .venv runs .pytest_cache .cache" in done.stdout


def test_the_makefile_says_how_large_the_venv_is():
    """It said "about 3 GB"; `du -sh .venv` measured 4.3 GiB."""
    venv = ROOT / ".venv" if (ROOT / ".venv").is_dir() else Path(sys.prefix)
    on_disk = 0  # what du counts: allocated blocks, links not followed
    for root, dirs, files in os.walk(venv):
        if Path(root) == venv:
            dirs[:] = [d for d in dirs if d != ".cache"]  # not the install
        on_disk += sum(os.lstat(os.path.join(root, n)).st_blocks * 512 for n in dirs + files)
    said = re.findall(r"about ([\d.]+) GiB", (ROOT / "Makefile").read_text())
    assert said and all(abs(float(x) - on_disk / 2**30) < 0.2 * on_disk / 2**30 for x in said), (
        said, f"{on_disk / 2**30:.2f} GiB measured in {venv}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory where the README's commands run as a user's would in the checkout: the
    Makefile, recipes and .venv of this one; runs/ of its own."""
    root = tmp_path_factory.mktemp("readme")
    for name in ("Makefile", "pyproject.toml", "recipes", "kdist", ".venv"):
        (root / name).symlink_to(ROOT / name)
    return root


@pytest.mark.slow
def test_the_readme_runs_as_written(workdir):
    env = child_environment(STEPS="2", EXTRA_ARGS=QUICK)
    env.pop("MAKEFLAGS", None)
    text = README.read_text()
    (workdir / "script.py").write_text(blocks(text, "python")[0])
    # The script's time is running code (its validation: 4 batches of 32 x 256 tokens
    # through gpt-nano, 1.7 CPU-s each), so XLA optimises it for run time: 51 CPU-s against
    # 63 (measured cold; with 16 batches, 71 against 105). The other commands compile more
    # than they run.
    script_env = {**env, "XLA_FLAGS": for_run_time(env.get("XLA_FLAGS", ""))}
    ran = []
    for command in [f"{sys.executable} script.py"] + [
            c for block in blocks(text, "bash") for c in commands(block) if c not in SKIPPED]:
        start = time.perf_counter()
        done = subprocess.run(command, shell=True, cwd=workdir, text=True, timeout=600,
                              env=script_env if command.endswith("script.py") else env,
                              capture_output=True)
        print(f"{time.perf_counter() - start:6.1f} s  {command}")
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        ran.append(command)
        if command.startswith("make run"):
            assert "outputs written to" in done.stdout
        if "kdist report" in command:
            assert (workdir / "runs" / "gpt_pretrain" / "report.png").is_file()
        if "kdist inspect" in command:
            assert "sha256" in done.stdout and "DAMAGED" not in done.stdout
    assert any(c.startswith("make run") for c in ran) and len(ran) >= 5, ran
    assert os.path.isdir(workdir / "runs" / "gpt_pretrain" / "checkpoints")
