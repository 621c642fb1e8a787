"""The accelerator table: per chip, the dense peak, memory and links; per host and slice,
how many chips share them. One table, read by MFU (:mod:`kdist.callbacks.peak`) and by the
planner (``kdist plan --device tpu-v5e``, :mod:`kdist.planning.target`).

Figures are the vendors' published specifications, per chip, dense (no sparsity):

* Google Cloud TPU documentation, one page per generation: "TPU v4", "TPU v5e", "TPU v5p"
  (its "v5p training" page), "TPU v6e" (cloud.google.com/tpu/docs/<version>). ICI is the
  page's bidirectional inter-chip bandwidth per chip; DCN the host's network (v5e: "Per-host
  NIC configuration 2 x 100 Gbps NIC", 6.4 Tbps per 256-chip Pod; v5p: "Data center network
  (DCN) bandwidth per chip 50 Gbps" x 4 chips per VM; v6e: "4 x 200 Gbps NIC", 25.6 Tbps per
  Pod). A v5e or v6e host holds 8 chips, but a multi-host slice is made of 4-chip VMs (the
  v6e page's slice table: 16x16 is 32 hosts, 64 VMs of ct6e-standard-4t; v5e's
  ct5lp-hightpu-4t), and one JAX process runs per VM: ``process_chips``. The v4 page gives
  neither ICI nor DCN bandwidth: None here.
* NVIDIA data sheets: "H100 Tensor Core GPU", "H200 Tensor Core GPU", "A100 Tensor Core
  GPU", "HGX B200" (per GPU), "GH200 Grace Hopper Superchip", "L40S", "L4"; NVLink per GPU
  as listed there; the hosts' network from the "DGX H100/H200/B200" (8 x 400 Gb/s) and
  "DGX A100" (8 x 200 Gb/s) data sheets — other servers differ: pass your own figures.

``slice_chips`` is the most chips one fast link joins: a TPU's largest single ICI slice
(the Pod, or v5p's 6,144-chip maximum shape; beyond it slices talk over DCN), a GPU
server's NVLink domain (its 8 GPUs; beyond it InfiniBand). On a TPU all chips of a slice
talk over ICI whether or not they share a host, so the slow boundary is the slice's.

``float32`` is the figure MFU uses for float32 compute: NVIDIA's dense TF32 peak (XLA lets
float32 matmuls use TF32 by default); on TPU, default-precision float32 matmuls run as
bfloat16 passes, so the bf16 figure.

Example:
    >>> accelerator("tpu-v5e").bf16_tflops, accelerator("tpu-v5e").hbm_bytes / 2**30
    (197.0, 16.0)
    >>> for_device_kind("TPU v5 lite").name, for_device_kind("cpu") is None
    ('tpu-v5e', True)
"""

from __future__ import annotations

import dataclasses

GIB = 2**30
GB = 10**9


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One accelerator's published figures (None where the source gives none).

    Example:
        >>> a = accelerator("h100")
        >>> a.fast_link, round(a.link_slowdown(), 1)
        ('NVLink', 9.0)
    """

    name: str  # the --device name
    kinds: tuple[str, ...]  # lower-case substrings of JAX's device_kind that mean this chip
    bf16_tflops: float
    float32_tflops: float  # what MFU uses for float32 compute (see the module docstring)
    int8_tops: float | None
    hbm_bytes: int | None
    hbm_gb_per_s: float | None
    fast_link: str  # "ICI", "NVLink" or "PCIe": between the chips of a slice / server
    fast_link_gb_per_s: float | None  # per chip, bidirectional (as published)
    slow_link: str  # "DCN" or "InfiniBand": between slices / servers
    slow_link_gbit_per_s: float | None  # per host, one direction (its NICs)
    chips_per_host: int
    process_chips: int  # chips of one VM, one JAX process, in a multi-host slice or cluster
    slice_chips: int  # the most chips one fast link joins (see the module docstring)
    source: str
    # For TPUs, the topology the TPU compiler plans for (kdist.planning.target):
    topology: str | None = None  # the name's prefix in jax's topologies ("v5e", "v5")
    chip_config: str = "default"  # "megacore": two TensorCores as one device (v4, v5p)
    torus_dims: int = 2

    @property
    def platform(self) -> str:
        return "tpu" if self.topology else "gpu"

    def tflops(self, dtype: str = "bfloat16") -> float:
        """The dense peak MFU divides by for a compute ``dtype``."""
        return self.float32_tflops if dtype in ("float32", "tf32") else self.bf16_tflops

    def link_slowdown(self) -> float | None:
        """How many times a chip's share of the slow link is slower than its fast link, each
        way: the planner's weight of bytes that cross slices (or servers). None when a
        figure is missing.

        Example:
            >>> accelerator("tpu-v5e").link_slowdown()  # 200 GB/s ICI vs 3.125 GB/s DCN
            64.0
        """
        if not self.fast_link_gb_per_s or not self.slow_link_gbit_per_s:
            return None
        fast = self.fast_link_gb_per_s / 2
        slow = self.slow_link_gbit_per_s / 8 / self.chips_per_host
        return fast / slow

    def describe(self) -> str:
        """One line: the figures a plan or a run log names.

        Example:
            >>> print(accelerator("tpu-v5e").describe())  # doctest: +ELLIPSIS
            tpu-v5e: 197 TFLOP/s bf16, 16 GiB HBM at 819 GB/s, ICI 400 GB/s per chip, ...
        """
        hbm = (f"{self.hbm_bytes / GIB:.4g} GiB HBM at {self.hbm_gb_per_s:.4g} GB/s"
               if self.hbm_bytes else "memory not in the table")
        fast = (f"{self.fast_link} {self.fast_link_gb_per_s:.4g} GB/s per chip"
                if self.fast_link_gb_per_s else f"{self.fast_link} bandwidth not published")
        slow = (f"{self.slow_link} {self.slow_link_gbit_per_s:.4g} Gb/s per host"
                if self.slow_link_gbit_per_s else f"{self.slow_link} bandwidth not published")
        return (f"{self.name}: {self.bf16_tflops:.4g} TFLOP/s bf16, {hbm}, {fast}, {slow}, "
                f"{self.chips_per_host} chips per host, up to {self.slice_chips} per "
                f"{'slice' if self.topology else 'server'} ({self.source})")


def _tpu(name, kinds, bf16, int8, hbm_gib, hbm_gb_per_s, ici, dcn_per_host, chips_per_host,
         slice_chips, page, topology, megacore=False) -> Accelerator:
    """A TPU generation: one JAX process per 4-chip VM on multi-host slices; bf16 also for
    float32 (default precision runs bf16 passes); megacore chips as v4 and v5p are, on a 3D
    torus."""
    return Accelerator(name, kinds, bf16, bf16, int8, hbm_gib * GIB, hbm_gb_per_s, "ICI", ici,
                       "DCN", dcn_per_host, chips_per_host, 4, slice_chips,
                       f"Google Cloud TPU docs, page '{page}'", topology,
                       "megacore" if megacore else "default", 3 if megacore else 2)


def _gpu(name, kinds, bf16, tf32, int8, hbm_gb, hbm_gb_per_s, source, nvlink=None,
         network=None, per_server=8, nvlink_domain=8, fast_link="NVLink") -> Accelerator:
    """An NVIDIA GPU in a server of ``per_server``: ``fast_link`` among ``nvlink_domain`` of
    them, the server's network (Gb/s, one way) beyond."""
    slow = "InfiniBand" if fast_link == "NVLink" else "Ethernet"
    return Accelerator(name, kinds, bf16, tf32, int8, hbm_gb * GB, hbm_gb_per_s, fast_link,
                       nvlink, slow, network, per_server, per_server, nvlink_domain, source)


_DGX = 8 * 400.0  # DGX H100 / H200 / B200: 8 x 400 Gb/s InfiniBand per server

# Order matters for device kinds: the first entry with a matching substring wins
# ("gh200" before "h200", "h100 pcie" before "h100", "tpu v5 lite" before "tpu v5").
ACCELERATORS: tuple[Accelerator, ...] = (
    _tpu("tpu-v5e", ("tpu v5 lite", "tpu v5e"), bf16=197.0, int8=393.0, hbm_gib=16,
         hbm_gb_per_s=819.0, ici=400.0, dcn_per_host=2 * 100.0, chips_per_host=8,
         slice_chips=256, page="TPU v5e", topology="v5e"),
    _tpu("tpu-v5p", ("tpu v5p", "tpu v5"), bf16=459.0, int8=None, hbm_gib=95,
         hbm_gb_per_s=2765.0, ici=1200.0, dcn_per_host=4 * 50.0, chips_per_host=4,
         slice_chips=6144, page="TPU v5p", topology="v5", megacore=True),
    _tpu("tpu-v6e", ("tpu v6 lite", "tpu v6e"), bf16=918.0, int8=1836.0, hbm_gib=32,
         hbm_gb_per_s=1638.0, ici=800.0, dcn_per_host=4 * 200.0, chips_per_host=8,
         slice_chips=256, page="TPU v6e", topology="v6e"),
    _tpu("tpu-v4", ("tpu v4",), bf16=275.0, int8=275.0, hbm_gib=32, hbm_gb_per_s=1200.0,
         ici=None, dcn_per_host=None, chips_per_host=4, slice_chips=4096, page="TPU v4",
         topology="v4", megacore=True),
    _gpu("gh200", ("gh200",), 989.0, 494.5, 1979.0, hbm_gb=96, hbm_gb_per_s=4000.0,
         per_server=1, nvlink_domain=1,
         source="NVIDIA 'GH200 Grace Hopper Superchip' data sheet"),
    _gpu("h200", ("h200",), 989.0, 494.5, 1979.0, hbm_gb=141, hbm_gb_per_s=4800.0,
         nvlink=900.0, network=_DGX,
         source="NVIDIA 'H200 Tensor Core GPU' (SXM) and 'DGX H200' data sheets"),
    _gpu("h100-pcie", ("h100 pcie",), 756.0, 378.0, 1513.0, hbm_gb=80, hbm_gb_per_s=2000.0,
         nvlink=600.0, nvlink_domain=2,
         source="NVIDIA 'H100 Tensor Core GPU' data sheet (PCIe; NVLink bridge pairs)"),
    _gpu("h100", ("h100",), 989.0, 494.5, 1979.0, hbm_gb=80, hbm_gb_per_s=3350.0,
         nvlink=900.0, network=_DGX,
         source="NVIDIA 'H100 Tensor Core GPU' (SXM) and 'DGX H100' data sheets"),
    _gpu("b200", ("b200",), 2250.0, 1100.0, 4500.0, hbm_gb=180, hbm_gb_per_s=8000.0,
         nvlink=1800.0, network=_DGX,
         source="NVIDIA 'HGX B200' (per GPU) and 'DGX B200' data sheets"),
    _gpu("a100-40gb", ("a100-sxm4-40gb", "a100-pcie-40gb"), 312.0, 156.0, 624.0, hbm_gb=40,
         hbm_gb_per_s=1555.0, nvlink=600.0, network=8 * 200.0,
         source="NVIDIA 'A100 Tensor Core GPU' and 'DGX A100' data sheets"),
    _gpu("a100", ("a100",), 312.0, 156.0, 624.0, hbm_gb=80, hbm_gb_per_s=2039.0,
         nvlink=600.0, network=8 * 200.0,
         source="NVIDIA 'A100 Tensor Core GPU' (80GB SXM) and 'DGX A100' data sheets"),
    _gpu("l40s", ("l40s",), 362.0, 183.0, 733.0, hbm_gb=48, hbm_gb_per_s=864.0,
         nvlink_domain=1, fast_link="PCIe", source="NVIDIA 'L40S' data sheet"),
    _gpu("l4", ("l4",), 121.0, 60.0, 242.0, hbm_gb=24, hbm_gb_per_s=300.0, nvlink_domain=1,
         fast_link="PCIe", source="NVIDIA 'L4' data sheet"),
    _gpu("a10g", ("a10g",), 70.0, 35.0, None, hbm_gb=24, hbm_gb_per_s=600.0, nvlink_domain=1,
         fast_link="PCIe", source="AWS G5 instances (NVIDIA A10G)"),
)
NAMES: tuple[str, ...] = tuple(a.name for a in ACCELERATORS)


def accelerator(name: str, flag: str = "--device") -> Accelerator:
    """The table's entry named ``name`` (case-insensitive; ``v5e`` or ``tpu_v5e`` too).

    Example:
        >>> accelerator("TPU-v5e").name
        'tpu-v5e'
        >>> accelerator("tpu-v9")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: --device tpu-v9 is not in kdist's accelerator table. Known: tpu-v5e, ...
    """
    key = str(name).strip().lower().replace("_", "-")
    for a in ACCELERATORS:
        if key in (a.name, a.name.removeprefix("tpu-")):
            return a
    raise ValueError(f"{flag} {name} is not in kdist's accelerator table. Known: "
                     f"{', '.join(NAMES)}. For another device, leave {flag} out and give "
                     f"its memory with --device-memory (e.g. 80GiB).")


def for_device_kind(device_kind: str) -> Accelerator | None:
    """The entry for a JAX ``device_kind`` (``"TPU v5 lite"``, ``"NVIDIA H100 80GB HBM3"``),
    or None for one the table does not know (a CPU).

    Example:
        >>> for_device_kind("NVIDIA H100 80GB HBM3").name, for_device_kind("TPU v5").name
        ('h100', 'tpu-v5p')
    """
    kind = str(device_kind).lower()
    for a in ACCELERATORS:
        if any(k in kind for k in a.kinds):
            return a
    return None
