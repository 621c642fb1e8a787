"""Fault trials of replica groups as separate jobs, and the time a failure costs against
today's relaunch from the last checkpoint.

    python benchmarks/fault_trials.py                  # ~30 min on 2 CPU cores
    python benchmarks/fault_trials.py --kills 3 --steps 80 --step-sleep 0.5   # ~12 min

Every run is ``tests/multihost_script.py groups``: the tiny GPT of the multi-process tests,
DiLoCo on ``replica=2,data=4`` (``--sync-every 3``), a checkpoint per group every round,
``--step-sleep`` seconds per batch so that start-up, rounds and kills land inside the run.

1. **Trials** (quorum, then async): ``python -m kdist.launch --replica-groups 2
   --spare-groups 1``; group 1's process is SIGKILLed ``--kills`` times — odd kills the
   moment its heartbeat says ``waiting`` (inside a quorum round's publish or wait) or
   ``publishing`` (inside an asynchronous round's publish),
   even ones at a random moment of a round — each once it has rejoined and run 2 steps.
   Printed: exit status, group 0's steps per second (median and slowest 10-step window, and
   over each kill's next 10 s), each rejoin's delay, the steps group 1 skipped on
   rejoining (it goes on from the job's step) and the steps each rejoin still started
   behind the job's step, the largest difference between the two groups' final weights
   (0.0 expected: both end with the job's outer state), the final validation losses
   against the run without faults, and the loss curve (the groups' mean per 20 steps) of
   both modes.
2. **Time lost per failure**, the same job: wall time with one kill minus without, for
   separate groups, and for today's single JAX job (``--processes 2``: one cluster, DiLoCo
   in one program) whose kill ends the job and whose relaunch resumes from the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "multihost_script.py")


class Run:
    """A launched job; every output line kept with its arrival time."""

    def __init__(self, args, env):
        self.lines, self.times, self.started = [], [], time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "kdist.launch", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=ROOT, env=env)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            self.times.append(time.monotonic())

    def wait_for(self, predicate, timeout=600, poll=0.05) -> bool:
        """Until ``predicate()`` holds (True), the job ends or ``timeout`` passes (False)."""
        end = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None or time.monotonic() > end:
                return False
            time.sleep(poll)
        return True

    def finish(self):
        status = self.proc.wait()
        self.reader.join()
        return status, time.monotonic() - self.started

    def steps(self, prefix):
        return [(int(x.split()[2]), t) for x, t in zip(self.lines, self.times)
                if x.startswith(f"[{prefix}] step ")]

    def newest_pid(self, marker):
        return [int(x.split()[-1]) for x in self.lines if x.startswith(marker)][-1]


def environment():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_DISTRIBUTION")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def script_args(out, args, tag):
    return [SCRIPT, "groups", "--mesh", "replica=2,data=4", "--sync-every",
            str(args.sync_every), "--steps", str(args.steps), "--out", str(out), "--tag", tag,
            "--ckpt", str(out / f"ckpt-{tag}"), "--save-every", str(args.sync_every),
            "--step-sleep", str(args.step_sleep), "--learning-rate", str(args.learning_rate)]


def groups_job(out, args, tag, kills, mode="quorum", seed=0):
    store = out / f"store-{tag}"
    run = Run(["--replica-groups", "2", "--spare-groups", "1", "--max-restarts", str(kills),
               "--devices-per-process", "4", "--replica-store", str(store),
               # (the deadline is a quorum round's: async rounds never wait, and refuse it)
               *(["--round-deadline", "10"] if mode == "quorum" else []), "--replica-mode", mode,
               *script_args(out, args, tag)], environment())
    rng, killed, joined, marks = random.Random(seed), [], [], []
    inside = 0  # kills sent while group 1's heartbeat said "waiting" or "publishing"
    for n in range(kills):
        seen = len(run.steps("g1"))
        if not run.wait_for(lambda seen=seen: len(run.steps("g1")) >= seen + 2):
            break  # the job ended first
        if n % 2:  # inside a round: publishing or waiting for the quorum (async: publishing)
            inside += run.wait_for(
                lambda: re.search(r'"(waiting|publishing)"',
                                  _read(store / "live" / "group-1.json")) is not None,
                timeout=30, poll=0.005)
        else:
            time.sleep(rng.uniform(0, args.sync_every * args.step_sleep))
        try:
            os.kill(run.newest_pid("[groups] group 1 rank 0 pid"), signal.SIGKILL)
        except ProcessLookupError:
            break
        killed.append(time.monotonic())
        mark = len(run.lines)  # group 1's join at the job's start may come before or after
        # group 0's: count only the join that follows this kill
        if not run.wait_for(lambda mark=mark: any("group 1 joined" in x
                                                  for x in run.lines[mark:])):
            break
        joined.append(time.monotonic())
        marks.append(mark)
    status, wall = run.finish()
    (out / f"{tag}.log").write_text("".join(run.lines))
    survivor = run.steps("g0")
    times = np.array([t for _, t in survivor])
    rates = 10 / np.diff(times[::10]) if len(times) > 20 else np.array([np.nan])
    after = [sum(1 for t in times if k < t <= k + 10) / 10 for k in killed]
    result = dict(status=status, wall_s=wall, kills=len(killed), kills_inside_a_round=inside,
                  rejoin_s=[j - k for j, k in zip(joined, killed)],
                  survivor_steps=len(survivor), survivor_steps_per_s_median=float(
                      np.median(rates)), survivor_steps_per_s_slowest=float(rates.min()),
                  survivor_steps_per_s_after_kills=after, output="".join(run.lines),
                  # distinct steps: a restart from an older checkpoint skips again some
                  # of the steps an earlier restart skipped
                  skipped_steps=len({step for x in run.lines for a, b in re.findall(
                      r"steps (\d+)-(\d+) skipped", x) for step in range(int(a), int(b) + 1)}))
    # Each join line says how far behind the job's step the group started (kdist.groups.sync).
    result["rejoin_steps_behind"] = [steps_behind(run.lines[mark:]) for mark in marks]
    result["max_weight_difference"] = weight_difference(out, tag)
    for g in (0, 1):
        record = json.loads((out / f"groups-g{g}-rank0.json").read_text())
        result[f"validation_g{g}"] = record["validation"]
        result[f"losses_g{g}"] = record["losses"]
    return result


def steps_behind(lines) -> int | None:
    """The steps behind the job's step that the first join among ``lines`` started."""
    join = next((x for x in lines if "[groups] group 1 joined" in x), "")
    found = re.search(r"(\d+) steps behind the job", join)
    return int(found.group(1)) if found else 0 if "the job's step" in join else None


def weight_difference(out, tag) -> float | None:
    """The largest absolute difference between the two groups' final weights (the script
    writes ``OUT/<tag>-g<group>.npz``); None if a group wrote none."""
    files = [out / f"{tag}-g{g}.npz" for g in (0, 1)]
    if not all(f.is_file() for f in files):
        return None
    with np.load(files[0]) as a, np.load(files[1]) as b:
        return max((float(np.max(np.abs(a[k] - b[k]))) for k in a.files), default=0.0)


def relaunch_job(out, args, tag, kill):
    """Today's: one JAX job of 2 processes (DiLoCo in one program); a killed rank ends the
    job, and the same command resumes it from the last checkpoint."""
    command = ["--processes", "2", "--devices-per-process", "4", "--grace", "5",
               *script_args(out, args, tag)]
    began = time.monotonic()
    run = Run(command, environment())
    if kill:
        run.wait_for(lambda: len(run.steps("0")) >= args.steps // 2)
        time.sleep(random.Random(1).uniform(0, args.sync_every * args.step_sleep))
        os.kill(run.newest_pid("[launch] rank 1 pid"), signal.SIGKILL)
        run.finish()
        run = Run(command, environment())
    status, _ = run.finish()
    return dict(status=status, wall_s=time.monotonic() - began)


def _read(path):
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def curve(result, every=20):
    steps = sorted(set(result["losses_g0"]) & set(result["losses_g1"]), key=int)
    return {int(s): round((result["losses_g0"][s] + result["losses_g1"][s]) / 2, 4)
            for s in steps if int(s) % every == 0}


def time_lost(out, args) -> dict:
    """Wall time with one kill minus without: separate groups, and today's single job
    relaunched from its checkpoint (``--time-lost-steps`` steps each)."""
    short = argparse.Namespace(**dict(vars(args), steps=args.time_lost_steps))
    base = groups_job(out / "groups-no-kill", short, "none", 0)["wall_s"]
    one = groups_job(out / "groups-one-kill", short, "one", 1)
    today = relaunch_job(out / "relaunch-clean", short, "relaunch", kill=False)
    today_kill = relaunch_job(out / "relaunch-kill", short, "relaunch", kill=True)
    print(f"time lost per failure: separate groups {one['wall_s'] - base:.1f} s (job "
          f"{one['wall_s']:.0f} s against {base:.0f} s); one job relaunched from its "
          f"checkpoint {today_kill['wall_s'] - today['wall_s']:.1f} s (job "
          f"{today_kill['wall_s']:.0f} s against {today['wall_s']:.0f} s)")
    return dict(groups_s=one["wall_s"] - base, groups_wall_s=one["wall_s"],
                groups_clean_wall_s=base, relaunch_s=today_kill["wall_s"] - today["wall_s"],
                relaunch_wall_s=today_kill["wall_s"], relaunch_clean_wall_s=today["wall_s"],
                relaunch_status=[today["status"], today_kill["status"]])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--sync-every", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.6)
    p.add_argument("--learning-rate", type=float, default=3e-4,
                   help="AdamW's peak: where the tiny corpus' validation loss still falls "
                        "at the end (at 1e-3 it rises after ~30 steps: overfitting)")
    p.add_argument("--time-lost-steps", type=int, default=60,
                   help="steps of the four runs that time one failure")
    p.add_argument("--no-time-lost", action="store_true",
                   help="the trials only, without the four runs that time one failure")
    p.add_argument("--modes", default="quorum,async",
                   help="the trials' replica modes, comma-separated")
    p.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--json", default=None, help="write the figures here too")
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="kdist-faults-"))
    out.mkdir(parents=True, exist_ok=True)
    figures = {}
    for mode in args.modes.split(","):
        clean = groups_job(out / f"{mode}-clean", args, "clean", 0, mode)
        trial = groups_job(out / f"{mode}-faults", args, "faults", args.kills, mode)
        figures[mode] = {k: v for k, v in trial.items() if k != "output"}
        figures[mode]["clean_wall_s"] = clean["wall_s"]
        figures[mode]["clean_validation"] = [clean["validation_g0"], clean["validation_g1"]]
        figures[mode]["curve_clean"], figures[mode]["curve_faults"] = curve(clean), curve(trial)
        print(f"{mode}: exit {trial['status']}, {trial['kills']} kills "
              f"({trial['kills_inside_a_round']} inside a round's publish or wait), rejoin "
              f"{np.median(trial['rejoin_s']) if trial['rejoin_s'] else 0:.1f} s median "
              f"(max {max(trial['rejoin_s'], default=0):.1f}); group 0 "
              f"{trial['survivor_steps']} steps, group 1 skipped {trial['skipped_steps']} on "
              f"rejoining and started {trial['rejoin_steps_behind']} steps behind the job's "
              f"step; max weight difference between the groups at the end "
              f"{trial['max_weight_difference']} (without faults "
              f"{clean['max_weight_difference']}), {trial['survivor_steps_per_s_median']:.2f} "
              f"steps/s median, slowest window {trial['survivor_steps_per_s_slowest']:.2f}; "
              f"after each kill {trial['survivor_steps_per_s_after_kills']}; validation "
              f"{trial['validation_g0']:.4f} / {trial['validation_g1']:.4f} against "
              f"{clean['validation_g0']:.4f} without faults", flush=True)
    if not args.no_time_lost:
        figures["time_lost"] = time_lost(out, args)
    for mode in args.modes.split(","):
        print(f"{mode} loss curve (groups' mean, every 20 steps): without faults "
              f"{figures[mode]['curve_clean']}; with {args.kills} kills "
              f"{figures[mode]['curve_faults']}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
