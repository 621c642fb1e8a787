"""Several runs on one figure: ``kdist report RUN_A RUN_B ...`` (e.g. bf16 against int8
matmuls, a dense model against its Mixture-of-Experts twin, one seed against another).

The panels are :func:`kdist.run_report.write_report`'s — each step's training loss, the
validations, tokens/s, step time — with one colour per run, named by its directory; the
text is each run's summary line and a table of the validation losses every run has at
the same step, each as a percentage of the first run's.

Example:
    >>> png, text = write_comparison(["runs/bf16", "runs/int8"])  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

from kdist.run_report import loss_series, read_rows, series, summarize

COMPARISON_PNG = "comparison.png"


def validation_table(runs: dict[str, list[dict]]) -> list[str]:
    """The validation losses of ``runs`` (name -> rows) at the steps they all reached, and
    each against the first run's: ``"step 100: bf16 5.8859, int8 5.8557 (-0.51 %)"``.

    Example:
        >>> validation_table({"a": [{"kind": "validation", "step": 5, "val_loss": 2.0}],
        ...                   "b": [{"kind": "validation", "step": 5, "val_loss": 2.01}]})
        ['validation loss (vs a):', '  step 5: a 2.0000, b 2.0100 (+0.50 %)']
    """
    curves = {name: dict(zip(*loss_series(rows)["validation"])) for name, rows in runs.items()}
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    if not steps:
        return ["validation loss: no step at which every run was validated"]
    first = next(iter(runs))
    lines = [f"validation loss (vs {first}):"]
    for step in steps:
        base = curves[first][step]
        cells = [f"{first} {base:.4f}"] + [
            f"{name} {c[step]:.4f} ({100 * (c[step] - base) / base:+.2f} %)"
            for name, c in curves.items() if name != first]
        lines.append(f"  step {step}: " + ", ".join(cells))
    return lines


def _names(run_dirs) -> list[str]:
    """Each run's label: its directory's name, or its whole path where two names clash."""
    names = [Path(d).name or str(d) for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]


def write_comparison(run_dirs, output: str | Path | None = None) -> tuple[Path, str]:
    """Plots two or more runs into one PNG (default ``comparison.png`` beside the first
    run's directory) and returns its path and the comparison's text."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    if len(run_dirs) < 2:
        raise ValueError("A comparison needs two or more run directories.")
    runs = dict(zip(_names(run_dirs), (read_rows(d) for d in run_dirs)))
    output = Path(output) if output else Path(run_dirs[0]).resolve().parent / COMPARISON_PNG
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    (loss_ax, val_ax), (tps_ax, time_ax) = axes
    for i, (name, rows) in enumerate(runs.items()):
        colour = f"C{i}"
        losses = loss_series(rows)
        train = losses.get("train_mean", losses["train"])
        loss_ax.plot(*train, linewidth=0.8, color=colour, label=name)
        val_ax.plot(*losses["validation"], "o-", color=colour, label=name)
        tps_ax.plot(*series(rows, "interval", "tokens_per_s"), color=colour, label=name)
        time_ax.plot(*series(rows, "interval", "step_time_median_s"), color=colour,
                     label=name)
    for ax, title, ylabel in ((loss_ax, "training loss (each step)", "loss"),
                              (val_ax, "validation loss", "loss"),
                              (tps_ax, "throughput", "tokens / s (global)"),
                              (time_ax, "step time (median per interval)", "seconds")):
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.legend()
    lines = [summarize(rows, name).splitlines()[0] for name, rows in runs.items()]
    lines += validation_table(runs)
    fig.suptitle(" vs ".join(runs), fontsize=10)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output, "\n".join(lines)
