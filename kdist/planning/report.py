"""A plan's result: the :class:`Plan` record, its text report, and the smallest change that
fits when it does not (:func:`suggest`).

Example:
    >>> p = Plan(config=dict(model="m", global_batch_size=8, sequence_length=16,
    ...          precision="float32", remat=False, grad_accum=1), mesh={"data": 1},
    ...          parameters=10, memory={"total": 100.0}, xla_memory={}, device_memory=1000,
    ...          flops={}, collectives={}, theoretical_collectives={}, compile_seconds=0.0)
    >>> p.fits
    True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from kdist import hlo
from kdist.parallel.mesh import mesh_spec, parse_mesh
from kdist.planning import stages, traffic
from kdist.planning.compile import memory_breakdown
from kdist.planning.units import USABLE_FRACTION, format_bytes


@dataclasses.dataclass
class Plan:
    """What one train step needs per device, from the compiled program. See
    :func:`kdist.planning.plan`."""

    config: dict[str, Any]
    mesh: dict[str, int]
    parameters: int
    memory: dict[str, float]  # per device: parameters, optimizer_state, gradients, ...
    xla_memory: dict[str, int]  # memory_analysis() fields
    device_memory: int
    flops: dict[str, float]
    collectives: dict[str, dict[str, float]]
    theoretical_collectives: dict[str, float]
    compile_seconds: float
    mesh_choice: str | None = None
    suggestion: dict[str, Any] | None = None
    pipeline: dict[str, Any] | None = None  # kdist.planning.stages.summary, with a stage axis
    device_memory_source: str = "given"  # where device_memory came from, in words
    # wire bytes per device per step over each mesh axis: {"compiled": ..., "theoretical":
    # ...} (kdist.planning.traffic: a collective over several axes split hierarchically)
    axis_bytes: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    crosses_hosts: list[str] = dataclasses.field(default_factory=list)
    devices_per_host: int | None = None
    # What the plan is for and how its figures were obtained (kdist.planning.target):
    # method "host" (compiled by XLA on this machine's devices), "tpu" (by the TPU compiler
    # ahead of time) or "estimate" (the analytic cost model, nothing compiled).
    target: str = ""
    method: str = "host"
    links: dict[str, Any] = dataclasses.field(default_factory=dict)  # kdist.planning._links
    # The planned configuration: kdist.distribution(plan.parallelism) trains what was planned
    parallelism: Any = None
    # Parameters one token goes through, where fewer than ``parameters`` (a Mixture of
    # Experts: the unchosen experts left out; the cost model's active_parameters), else None.
    active_parameters: int | None = None

    @property
    def total(self) -> float:
        """Planned peak bytes per device."""
        return self.memory["total"]

    @property
    def fits(self) -> bool:
        """Whether the peak is within the usable share of the device's memory."""
        return self.total <= self.device_memory * USABLE_FRACTION

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain data (``kdist plan --json``)."""
        out = dataclasses.asdict(self)
        out.update(total=self.total, fits=self.fits, usable_fraction=USABLE_FRACTION)
        return out

    def report(self) -> str:
        """The plan as a few lines of text (what ``kdist plan`` prints)."""
        c = self.config
        lines = [f"device memory: {format_bytes(self.device_memory)} per device "
                 f"({self.device_memory_source})"]
        if self.target and (self.method != "host" or self.links.get("group") != "host"):
            lines.append(f"target: {self.target}")  # another device, or not compiled
        active = (f", {self.active_parameters:,} active" if self.active_parameters
                  else "")
        lines.append(f"plan: {c['model']} ({self.parameters:,} parameters{active}), mesh "
                     f"{mesh_spec(self.mesh)} over {math.prod(self.mesh.values())} devices, "
                     f"global batch {c['global_batch_size']} x {c['sequence_length']}, "
                     f"{c['precision']}, remat {c['remat']}, gradient accumulation "
                     f"{c['grad_accum']}")
        if self.mesh_choice:
            lines.append(f"mesh auto: {self.mesh_choice}")
        lines += self._memory_lines() + self._flops_lines() + self._collective_lines()
        if self.pipeline:
            lines += stages.report_lines(self.pipeline, format_bytes)
        lines.append(f"compile: {self.compile_seconds:.1f} s" if self.method != "estimate"
                     else f"estimate: {self.compile_seconds:.2f} s (nothing compiled)")
        return "\n".join(lines + self._verdict_lines())

    def _memory_lines(self) -> list[str]:
        m = self.memory
        lines = [{"host": "memory per device (XLA memory_analysis; peak = arguments + "
                          "temporaries + outputs not aliased + generated code):",
                  "tpu": "memory per chip (the TPU compiler's memory_analysis; peak = "
                         "arguments + temporaries + outputs not aliased + generated code):",
                  "estimate": "memory per device (ESTIMATED by the analytic cost model, "
                              "nothing compiled):"}[self.method]]
        for key, label in (("parameters", "parameters"), ("optimizer_state", "optimizer state"),
                           ("gradients", "gradients (in temporaries)"),
                           ("activations_and_temporaries", "activations + other temporaries"),
                           ("batch_and_other", "batch, program code, other"),
                           ("total", "total (peak)")):
            lines.append(f"  {label:<34}{format_bytes(m[key]):>12}")
        lines.append(f"  {'device memory':<34}{format_bytes(self.device_memory):>12}"
                     f"  (plan uses {self.total / self.device_memory:.0%}; budget "
                     f"{USABLE_FRACTION:.0%})")
        return lines

    def _flops_lines(self) -> list[str]:
        f = self.flops
        if self.method == "estimate":
            return [f"FLOPs per optimizer step: formula {f['formula']:.4g} (estimated; no "
                    f"compiled program to count)"]
        if "schedule_formula" in f:
            return self._scheduled_flops_lines()
        lines = [f"FLOPs per optimizer step: XLA {f['xla']:.4g}, formula {f['formula']:.4g} "
                 f"(XLA / formula {f['xla'] / f['formula']:.3f}; loop bodies' matmuls counted "
                 f"per iteration)"]
        if f.get("program") and self.mesh.get("stage", 1) > 1:
            lines.append(
                f"  the pipelined program's matmuls: {f['program']:.4g} "
                f"({f['program'] / f['formula']:.3f} x formula: the bubble computes on "
                f"zeros). MFU uses the formula, the model's FLOPs")
        return lines

    def _scheduled_flops_lines(self) -> list[str]:
        """A pipeline interpreter's program (kdist.planning.executed): what it executes,
        each branch of the tick's switch as often as the schedule's table runs it."""
        f = self.flops
        recompute = f["schedule_formula"] / f["formula"] - 1
        return [
            f"FLOPs per optimizer step: XLA {f['xla']:.4g} executed (each task of the tick's "
            f"switch as often as the schedule runs it), formula {f['formula']:.4g} "
            f"(XLA / formula {f['xla'] / f['formula']:.3f})",
            f"  the schedule's backwards recompute their forwards: formula + recomputation "
            f"{f['schedule_formula']:.4g} (+{recompute:.1%}); XLA / that "
            f"{f['xla'] / f['schedule_formula']:.3f} (the rest: XLA's full T x T attention "
            f"and its non-matmul ops). MFU uses the formula, the model's FLOPs",
            f"  the program contains {f['contained']:.4g} matmul FLOPs with every branch "
            f"at every tick ({f['contained'] / f['formula']:.1f} x formula): what XLA's "
            f"counters read, not what runs"]

    def _collective_lines(self) -> list[str]:
        if self.method != "host":
            return self._theory_lines()
        if not self.collectives:
            return ["collectives: none (one device, or nothing sharded)"]
        lines = ["collectives per step (per device; wire = ring bytes sent" + (
            "; those inside the tick's switch as often as the schedule runs their task, "
            "on average over the stages):" if "schedule_formula" in self.flops else "):")]
        empty = {"count": 0, "bytes": 0.0, "wire_bytes": 0.0}
        for kind in hlo.COLLECTIVE_KINDS:
            if kind not in self.collectives and kind not in self.theoretical_collectives:
                continue
            row = self.collectives.get(kind, empty)
            theory = self.theoretical_collectives.get(kind)
            extra = f", theoretical min {format_bytes(theory)}" if theory else ""
            lines.append(f"  {kind:<20}{round(row['count']):>5} x, {format_bytes(row['bytes'])}"
                         f" logical, {format_bytes(row['wire_bytes'])} wire{extra}")
        lines += self._axis_lines()
        actual = sum(r["wire_bytes"] for r in self.collectives.values())
        theory = sum(self.theoretical_collectives.values())
        if theory:
            lines.append(f"  {'total':<20}{'':>8}{format_bytes(actual)} wire, theoretical "
                         f"min {format_bytes(theory)} ({actual / theory:.2f}x; see "
                         f"benchmarks/README.md for why)")
        return lines

    def _theory_lines(self) -> list[str]:
        """The collectives of a plan whose program's were not counted: the theoretical
        minimum, by kind and per axis with the link each axis uses."""
        why = ("estimated: nothing compiled" if self.method == "estimate" else
               "theoretical: the TPU program's collectives are asynchronous, decomposed and "
               "looped, which kdist.hlo does not count yet")
        theory = self.theoretical_collectives
        if not theory:
            return ["collectives: none (one device, or nothing sharded)"]
        lines = [f"collectives per step (per device, ring wire bytes; {why}):"]
        for kind in hlo.COLLECTIVE_KINDS:
            if theory.get(kind):
                lines.append(f"  {kind:<20}theoretical min {format_bytes(theory[kind])}")
        return lines + self._axis_lines()

    def _axis_lines(self) -> list[str]:
        compiled = self.axis_bytes.get("compiled", {})
        theory = self.axis_bytes.get("theoretical", {})
        if not compiled and not theory:
            return []
        links = self.links if self.links.get("group") in ("slice", "server") else None
        hosts = (f"{self.devices_per_host} devices per host" if self.devices_per_host
                 else "one host")
        if links:
            hosts = (f"{links['fast']} inside a {links['group']} of "
                     f"{links['devices_per_group']}, {links['slow']} between "
                     f"{links['group']}s, {links['slow']} bytes weigh "
                     f"{links['slowdown']:.3g}x in --mesh auto")
        lines = [f"  per mesh axis (wire, a collective over several axes split "
                 f"hierarchically; {hosts}):"]
        for axis in [a for a in self.mesh if a in compiled or a in theory]:
            extra = (f", theoretical min {format_bytes(theory[axis])}" if axis in theory
                     else "")
            where = "  crosses hosts" if axis in self.crosses_hosts else ""
            if links:
                share = links["slow_share"].get(axis)
                where = (f"  {links['slow']}: crosses {links['group']}s "
                         f"({traffic.percent(share)} of its bytes)" if share
                         else f"  {links['fast']}")
            every = self.config.get("sync_every")
            if axis == "replica" and every:
                step = compiled or theory
                where += (f"  (the sync step {'compiled' if compiled else 'estimated'}; every "
                          f"{every} steps: {format_bytes(step.get(axis, 0.0) / every)} per "
                          f"step)")
            shown = (f"{format_bytes(compiled.get(axis, 0.0)):>12} wire{extra}" if compiled
                     else f"{format_bytes(theory.get(axis, 0.0)):>12} wire, theoretical min")
            lines.append(f"    {axis:<18}{shown}{where}")
        return lines

    def _verdict_lines(self) -> list[str]:
        if self.fits:
            return [f"verdict: FITS — {format_bytes(self.total)} of "
                    f"{format_bytes(self.device_memory)} per device"]
        lines = [f"verdict: DOES NOT FIT — {format_bytes(self.total)} needed, "
                 f"{format_bytes(self.device_memory * USABLE_FRACTION)} usable"]
        s = self.suggestion
        if s:
            how = "compiled" if s.get("verified") else "estimated"
            lines.append(f"suggestion: {s['change']} -> {format_bytes(s['total'])} per "
                         f"device ({how})" + ("" if s.get("fits", True) else
                                              " — still does not fit"))
        else:
            lines.append("suggestion: none found: use more devices or a smaller model")
        return lines


def suggest(result: Plan, remat_ratio: float, run: Callable | None) -> dict | None:
    """The smallest change that fits: more fsdp, then gradient accumulation, then remat
    (and their combinations), estimated by scaling the compiled figures, then (if ``run``)
    compiled to confirm.

    ``remat_ratio`` is the activations with remat over those without (the cost model's
    ``activation_bytes_per_token``; 1.0 when unknown or already on); ``run(sizes, remat,
    grad_accum)`` compiles a candidate and returns ``(compiled, state, model)``. Returns
    ``{"change", "mesh", "remat", "grad_accum", "total", "fits", "verified"}`` or None.
    """
    budget = result.device_memory * USABLE_FRACTION
    options = _options(result, remat_ratio, budget)
    fitting = sorted((o for o in options if o[1]["fits"]), key=lambda o: o[0])
    if not fitting:
        best = min(options, key=lambda o: o[1]["total"])[1] if options else None
        return best
    if run is None:
        return fitting[0][1]
    # Compile candidates in order until one really fits (an estimate can be wrong: on
    # XLA:CPU, remat recomputes but does not lower the compiled peak).
    for _, candidate in fitting[:3]:
        sizes = parse_mesh(candidate["mesh"], math.prod(result.mesh.values()))
        compiled, state_specs, _ = run(sizes, candidate["remat"], candidate["grad_accum"])
        candidate["total"] = memory_breakdown(compiled, state_specs)["total"]
        candidate["fits"] = candidate["total"] <= budget
        candidate["verified"] = True
        if candidate["fits"]:
            return candidate
    return min((o[1] for o in fitting[:3]), key=lambda c: c["total"])


def _options(result: Plan, remat_ratio: float, budget: float) -> list[tuple]:
    """Every candidate change with its estimated per-device total and ranking cost."""
    c, m = result.config, result.memory
    state = m["parameters"] + m["optimizer_state"] + m["gradients"]
    activations = m["activations_and_temporaries"]
    other = m["batch_and_other"]
    mesh = dict(result.mesh)
    micro_per_replica = c["global_batch_size"] // c["grad_accum"] // (mesh["data"] * mesh["fsdp"])
    options = []
    fsdp_meshes = [mesh]
    if mesh["data"] > 1:
        fsdp_meshes.append({**mesh, "data": 1, "fsdp": mesh["fsdp"] * mesh["data"]})
    for new_mesh in fsdp_meshes:
        shard = (mesh["fsdp"] * mesh["model"]) / (new_mesh["fsdp"] * new_mesh["model"])
        for remat in ([False, True] if not c["remat"] else [True]):
            for k in (1, 2, 4, 8, 16, 32, 64):
                if k > micro_per_replica or micro_per_replica % k:
                    continue
                accum = c["grad_accum"] * k
                changes = []
                if new_mesh != mesh:
                    changes.append(f"--mesh {mesh_spec(new_mesh)}")
                if remat and not c["remat"]:
                    changes.append("--remat block")
                if k > 1:
                    changes.append(f"--grad-accum {accum} (micro-batch "
                                   f"{c['global_batch_size'] // accum})")
                if not changes:
                    continue
                act = activations * (remat_ratio if remat and not c["remat"] else 1.0) / k
                extra = m["parameters"] * shard if accum > 1 and c["grad_accum"] == 1 else 0
                total = state * shard + extra + act + other
                # Fewest changes first; then fsdp (free in memory terms), accumulation
                # (smaller micro-batches), remat (a third more compute).
                cost = (len(changes), new_mesh == mesh, remat, k)
                options.append((cost, {"change": " ".join(changes), "mesh": mesh_spec(new_mesh),
                                       "remat": remat or c["remat"], "grad_accum": accum,
                                       "total": total, "fits": total <= budget,
                                       "verified": False}))
    return options
