"""What a plan is for, and how its figures are obtained.

Without ``device``, a plan is for this machine's own devices (on a CPU, N forced host
devices): the train step is compiled here and its figures are XLA's for them. With
``device="tpu-v5e"`` (any name of :mod:`kdist.accelerators`) it is for that accelerator —
its HBM per chip, its fast link inside a slice (ICI; NVLink inside a GPU server) and its
slow link between slices (DCN; InfiniBand between servers) — and the figures come from,
in order of honesty:

* ``"tpu"``: the TPU compiler itself, ahead of time, for the slice's topology
  (``jax.experimental.topologies``, as MaxText's ``train_compile.py``), where ``libtpu`` is
  installed — on this CPU too: nothing runs, every figure is the TPU program's own;
* ``"host"``: XLA on this machine's devices standing in for the accelerator's (asked for
  with ``compile="host"``, or when this machine has those devices): the sharding and the
  collectives are the program's, the memory is this backend's compiler's;
* ``"estimate"``: the analytic cost model (:mod:`kdist.planning.estimate`), nothing compiled.

``compile="auto"`` takes the first that applies; the report says which one it was, and a
figure is never called compiled when it was estimated.

Example:
    >>> t = resolve("tpu-v5e", 256, compile="none")
    >>> t.method, t.device_memory // 2**30, t.link_group, t.fast_link, t.slow_link
    ('estimate', 16, 256, 'ICI', 'DCN')
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from collections.abc import Sequence

from kdist.accelerators import Accelerator, accelerator
from kdist.planning.traffic import HOST_LINK_SLOWDOWN
from kdist.planning.units import default_device_memory, device_memory_source, parse_bytes

COMPILERS = ("auto", "tpu", "host", "none")


@dataclasses.dataclass(frozen=True)
class Target:
    """The devices a plan is for and how its figures are obtained (see the module
    docstring); built by :func:`resolve`."""

    num_devices: int
    device_memory: int
    memory_source: str  # where device_memory comes from, in words
    devices_per_host: int  # one JAX process's devices
    link_group: int  # devices the fast link joins (a TPU slice, a server, a host)
    fast_link: str  # e.g. "ICI"; "inside a host" for this machine's devices
    slow_link: str  # e.g. "DCN"; "between hosts"
    group_name: str  # "slice", "server" or "host": what link_group devices are
    slowdown: float  # how much a byte over the slow link weighs when ranking meshes
    method: str  # "tpu", "host" or "estimate"
    how: str  # the method in words, for the report
    accelerator: Accelerator | None = None
    devices: tuple | None = None  # what the program is compiled for (None: estimated)
    topology: str | None = None  # a TPU slice's shape, e.g. "v5e:16x16"

    @property
    def compiled(self) -> bool:
        return self.method != "estimate"

    @property
    def slices(self) -> int:
        """How many link groups the devices span (1: every byte on the fast link)."""
        return max(1, self.num_devices // self.link_group)

    def describe(self) -> str:
        """The report's ``target:`` line.

        Example:
            >>> resolve("tpu-v5e", 512, compile="none").describe()  # doctest: +ELLIPSIS
            'tpu-v5e x 512: 2 slices of 256 chips (ICI inside a slice, DCN between: ...'
        """
        if self.accelerator is None:
            return f"{self.num_devices} device(s) of this machine: {self.how}"
        a = self.accelerator
        unit = ("chip" if a.topology else "GPU") + ("s" if self.link_group > 1 else "")
        groups = (f"{self.slices} {self.group_name}s of {self.link_group} {unit}"
                  if self.slices > 1 else f"one {self.group_name} of {self.link_group} {unit}")
        return (f"{a.name} x {self.num_devices}: {groups} ({self.fast_link} inside a "
                f"{self.group_name}, {self.slow_link} between: its bytes weigh "
                f"{self.slowdown:.3g}x), {self.devices_per_host} per process; {self.how}")


def running_links(devices: Sequence | None = None) -> tuple[int, float, str]:
    """``(devices per fast-link group, slow-link weight, what a group is)`` of the devices a
    run has (default ``jax.devices()``), for ``--mesh auto`` in the recipes: a TPU's slice
    (every chip of it on ICI, whatever its host) and its DCN weight from the table; a GPU's
    server (its process's devices); else this host, 9x.

    Example:
        >>> running_links()[2] in ("slices", "servers", "hosts")
        True
    """
    from kdist.accelerators import for_device_kind

    if devices is None:
        import jax

        devices = jax.devices()
    first = devices[0]
    entry = None if first.platform == "cpu" else for_device_kind(first.device_kind)
    if entry is not None and entry.topology:
        slice_of = getattr(first, "slice_index", 0)
        group = sum(getattr(d, "slice_index", 0) == slice_of for d in devices)
        return group, entry.link_slowdown() or HOST_LINK_SLOWDOWN, "slices"
    local = sum(d.process_index == first.process_index for d in devices)
    if entry is not None:
        return local, entry.link_slowdown() or HOST_LINK_SLOWDOWN, "servers"
    return local, HOST_LINK_SLOWDOWN, "hosts"


def libtpu_available() -> bool:
    """Whether the TPU compiler can be loaded here (the ``libtpu`` package).

    Example:
        >>> isinstance(libtpu_available(), bool)
        True
    """
    return importlib.util.find_spec("libtpu") is not None


def resolve(device: str | None, num_devices: int, *, compile: str = "auto",
            slices: int | None = None, devices_per_host: int | None = None,
            device_memory: int | str | None = None, devices: Sequence | None = None
            ) -> Target:
    """The :class:`Target` of a plan over ``num_devices`` devices of ``device`` (None: this
    machine's ``devices``, default ``jax.devices()``). ``compile``: ``"auto"``, ``"tpu"``,
    ``"host"`` or ``"none"`` (see the module docstring); ``slices``: TPU slices joined by
    DCN (default: the fewest that hold the devices); ``devices_per_host``,
    ``device_memory``: instead of the table's (or this machine's) figures.

    Example:
        >>> resolve("h100", 16, compile="none").describe()  # doctest: +ELLIPSIS
        'h100 x 16: 2 servers of 8 GPUs (NVLink inside a server, InfiniBand between: ...'
    """
    if compile not in COMPILERS:
        raise ValueError(f"--compile {compile} is not one of {', '.join(COMPILERS)}: auto "
                         f"(the TPU compiler where libtpu is installed, else this machine's "
                         f"devices for them, else an estimate), tpu, host or none.")
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"--devices must be a positive integer; got {num_devices!r}.")
    if device is None:
        return _this_machine(num_devices, compile, slices, devices_per_host, device_memory,
                             devices)
    entry = accelerator(device)
    group, group_name = _link_group(entry, num_devices, slices)
    per_host = devices_per_host or (group if group <= entry.chips_per_host
                                    else entry.process_chips)
    if isinstance(per_host, bool) or not isinstance(per_host, int) or per_host < 1:
        raise ValueError(f"--devices-per-host must be a positive integer; got {per_host!r}.")
    memory, memory_source = _memory(entry, device_memory)
    slowdown = entry.link_slowdown()
    common = dict(num_devices=num_devices, device_memory=memory, memory_source=memory_source,
                  devices_per_host=per_host, link_group=group, fast_link=entry.fast_link,
                  slow_link=entry.slow_link, group_name=group_name,
                  slowdown=slowdown or HOST_LINK_SLOWDOWN, accelerator=entry)
    method = _method(entry, compile, num_devices)
    if method == "tpu":
        topology, chips = tpu_devices(entry, group, num_devices // group)
        return Target(**common, method="tpu", devices=tuple(chips), topology=topology,
                      how=f"compiled by the TPU compiler (libtpu) for {topology} x "
                          f"{num_devices // group} slice(s), ahead of time: the program's "
                          f"own memory and FLOPs, nothing run")
    if method == "host":
        here = _local_devices(devices, num_devices, f"--device {device} --compile host")
        return Target(**common, method="host", devices=tuple(here),
                      how=f"compiled by XLA on this machine's {num_devices} "
                          f"{here[0].platform} devices standing in for {entry.name}: its "
                          f"sharding and collectives, but {here[0].platform}'s memory "
                          f"figures, not {entry.name}'s")
    why = ("--compile none" if compile == "none" else
           "no TPU compiler here: pip install 'jax[tpu]' brings libtpu, which compiles for "
           "the slice from this CPU; or --compile host, XLA on this machine's devices "
           "standing in" if entry.topology else
           f"no {entry.name} here; --compile host compiles on this machine's devices, "
           f"standing in")
    return Target(**common, method="estimate",
                  how=f"ESTIMATED by the analytic cost model, nothing compiled ({why})")


def _this_machine(num_devices, compile, slices, devices_per_host, device_memory, devices):
    if compile == "tpu":
        raise ValueError("--compile tpu compiles for a named TPU: add --device tpu-v5e (or "
                         "tpu-v5p, tpu-v6e, tpu-v4).")
    if slices is not None:
        raise ValueError("--slices counts TPU slices: add --device tpu-v5e (or another TPU).")
    here = _local_devices(devices, num_devices, "kdist plan")
    per_host = devices_per_host or sum(d.process_index == here[0].process_index for d in here)
    if isinstance(per_host, bool) or not isinstance(per_host, int) or per_host < 1:
        raise ValueError(f"devices_per_host must be a positive integer (the devices of one "
                         f"host); got {per_host!r}.")
    memory = (parse_bytes(device_memory) if device_memory is not None
              else default_device_memory(here[0]))
    source = "given" if device_memory is not None else device_memory_source(here[0])
    common = dict(num_devices=num_devices, device_memory=memory, memory_source=source,
                  devices_per_host=per_host, link_group=per_host, fast_link="inside a host",
                  slow_link="between hosts", group_name="host", slowdown=HOST_LINK_SLOWDOWN)
    if compile == "none":
        return Target(**common, method="estimate",
                      how="ESTIMATED by the analytic cost model, nothing compiled "
                          "(--compile none)")
    return Target(**common, method="host", devices=tuple(here),
                  how=f"compiled by XLA for them ({here[0].platform})")


def _local_devices(devices, num_devices, what) -> list:
    import jax

    here = list(devices) if devices is not None else jax.devices()
    if len(here) < num_devices:
        raise ValueError(
            f"{what}: {num_devices} devices are needed but this process has {len(here)}. On "
            f"CPU, call kdist.force_host_devices({num_devices}) before jax starts (the `kdist "
            f"plan` command does this itself).")
    return here[:num_devices]


def _link_group(entry: Accelerator, num_devices: int, slices: int | None) -> tuple[int, str]:
    """``(devices per fast-link group, its name)``: a TPU's slices, a GPU's servers."""
    if not entry.topology:
        if slices is not None:
            raise ValueError(f"--slices counts TPU slices; {entry.name} is a GPU, whose "
                             f"NVLink domain is a server of {entry.slice_chips}: leave it out.")
        return min(num_devices, entry.slice_chips), "server"
    if slices is None:
        slices = math.ceil(num_devices / entry.slice_chips)
    if isinstance(slices, bool) or not isinstance(slices, int) or slices < 1 \
            or num_devices % slices:
        raise ValueError(f"--slices {slices} must be a positive divisor of --devices "
                         f"{num_devices} (each slice holds the same number of chips).")
    per_slice = num_devices // slices
    if per_slice > entry.slice_chips:
        raise ValueError(
            f"--devices {num_devices} in --slices {slices} puts {per_slice} chips in a "
            f"slice, but one {entry.name} slice holds at most {entry.slice_chips}: use "
            f"--slices {math.ceil(num_devices / entry.slice_chips)} or more.")
    return per_slice, "slice"


def _memory(entry: Accelerator, device_memory) -> tuple[int, str]:
    if device_memory is not None:
        return parse_bytes(device_memory), "given"
    if not entry.hbm_bytes:
        raise ValueError(f"kdist's table has no memory figure for {entry.name}: pass "
                         f"--device-memory (e.g. 80GiB).")
    return entry.hbm_bytes, f"{entry.name}'s HBM per chip, from {entry.source}"


def _method(entry: Accelerator, compile: str, num_devices: int) -> str:
    if compile == "none":
        return "estimate"
    if compile == "host":
        return "host"
    tpu_ok = bool(entry.topology) and libtpu_available()
    if compile == "tpu":
        if not entry.topology:
            raise ValueError(f"--compile tpu compiles for a TPU; {entry.name} is not one. "
                             f"Use --compile auto, host or none.")
        if not tpu_ok:
            raise ValueError("--compile tpu needs the TPU compiler, which is not installed "
                             "here: pip install 'jax[tpu]' (it brings libtpu; it compiles "
                             "on a CPU too), or use --compile none for an estimate.")
        return "tpu"
    if tpu_ok:
        return "tpu"
    return "host" if _here(entry, num_devices) else "estimate"


def _here(entry: Accelerator, num_devices: int) -> bool:
    """Whether this process has ``num_devices`` devices of ``entry``'s kind (then compiling
    on them is compiling for them)."""
    import jax

    from kdist.accelerators import for_device_kind

    here = jax.devices()
    return (here[0].platform != "cpu" and len(here) >= num_devices
            and for_device_kind(here[0].device_kind) is entry)


def tpu_devices(entry: Accelerator, per_slice: int, slices: int) -> tuple[str, list]:
    """``(topology name, devices)`` of ``slices`` slices of ``per_slice`` chips of a TPU,
    for the TPU compiler ahead of time (no chip needed). Devices come slice by slice,
    process by process: the order ``jax.devices()`` gives on the slices, which kdist's
    mesh lays out slowest axis first (:mod:`kdist.parallel.mesh`).

    Example:
        >>> tpu_devices(accelerator("tpu-v5e"), 256, 1)[0]  # doctest: +SKIP
        'v5e:16x16'
    """
    prepare_tpu_compiler()
    from jax.experimental import topologies

    dims = topology_shape(per_slice, entry.torus_dims)
    name = f"{entry.topology}:{'x'.join(map(str, dims))}"
    process = min(per_slice, entry.process_chips)
    # A process's chips, as a block of the torus (x, y, z).
    bounds = topology_shape(process, entry.torus_dims) + (1,) * (3 - entry.torus_dims)
    try:
        topology = topologies.get_topology_desc(
            platform="tpu", topology_name=name, chip_config_name=entry.chip_config,
            chips_per_host_bounds=bounds, num_slices=slices)
    except Exception as e:  # noqa: BLE001 - libtpu's errors are of its own types
        raise ValueError(f"The TPU compiler refused the topology {name} x {slices} slice(s) "
                         f"({type(e).__name__}: {e}). Plan a slice of a supported size "
                         f"(a power of two chips up to {entry.slice_chips}), or use "
                         f"--compile none for an estimate.") from None
    return name, list(topology.devices)


def topology_shape(chips: int, dims: int) -> tuple[int, ...]:
    """The torus shape of a slice of ``chips`` (a power of two): as square as can be, the
    larger sides last, as Google names slices (``16x16``, ``2x4``; ``4x4x8``, ``2x2x1``).

    Example:
        >>> topology_shape(256, 2), topology_shape(8, 2)
        ((16, 16), (2, 4))
        >>> topology_shape(128, 3), topology_shape(4, 3)
        ((4, 4, 8), (2, 2, 1))
    """
    if chips < 1 or chips & (chips - 1):
        raise ValueError(f"A TPU slice holds a power of two chips; {chips} is not one: choose "
                         f"--devices (and --slices) so that each slice has 1, 2, 4, 8, ... "
                         f"chips.")
    bits = chips.bit_length() - 1
    shape = [2 ** (bits // dims + (i >= dims - bits % dims)) for i in range(dims)]
    if dims == 3 and bits == 2:
        return (2, 2, 1)  # the v4 / v5p host block
    return tuple(shape)


def prepare_tpu_compiler() -> None:
    """Settings for using the TPU compiler without a TPU, set (unless the user set them)
    before JAX starts: the CPU as JAX's own platform (no chip is opened: nothing runs), no
    metadata-server query (there is none off Google Cloud), and no claim on the libtpu lock
    a training process on this machine may hold."""
    from kdist import _keras_compat

    if _keras_compat.jax_backends_started():
        return
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # read by libtpu when it loads
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if not os.environ.get("JAX_PLATFORMS"):
        import jax  # its configuration read JAX_PLATFORMS at import: set it there

        jax.config.update("jax_platforms", "cpu")
