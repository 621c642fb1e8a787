"""Defaults chosen by the device: the device a program is traced for, the attention
implementation and its tiles, what ``remat="auto"`` keeps, the batch a recipe trains with.

A model's ``attention_implementation="auto"`` (the default) is resolved when the training
step is traced, from the device the program is compiled for (:func:`target`) and the
shapes: every choice here was measured (``benchmarks/attention.py`` on a TPU v5e chip,
``benchmarks/README.md``), and a CPU keeps the simplest exact path. ``assume`` names a
device to compile for when it is not the one JAX runs on (planning a TPU step on a CPU).

=============  ===============================================================================
``"xla"``      ``keras.ops.dot_product_attention``: XLA's attention (cuDNN's flash
               attention on an NVIDIA GPU, where Keras picks it); keeps ``(B, N, T, S)``
               float32 probabilities for the backward pass elsewhere
``"chunked"``  :func:`kdist.models.chunked_attention.chunked_attention`: an online softmax over key
               chunks in plain JAX, any mask, any length
``"splash"``   :func:`kdist.kernels.splash.splash_attention`: Pallas flash attention on a
               TPU (interpreted elsewhere): causal or not, documents by segment ids
``"flash"``    :func:`kdist.kernels.flash.flash_attention`: kdist's own Pallas kernels for
               the TPU (interpreted elsewhere), the same masks; an example's keys whole in
               VMEM
=============  ===============================================================================

Example:
    >>> attention_for(Target("tpu", "TPU v5 lite"), queries=1024, keys=1024, head_dim=64,
    ...               arbitrary_mask=False, chunk_size=None)
    'flash'
    >>> attention_for(Target("cpu", "cpu"), queries=1024, keys=1024, head_dim=64,
    ...               arbitrary_mask=False, chunk_size=None)
    'xla'
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

from kdist.kernels.flash import FlashBlocks
from kdist.kernels.flash import supports as flash_supports
from kdist.kernels.splash import Blocks, supports

ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "chunked", "splash", "flash")
# Keys per chunk of "chunked" when the model names none.
DEFAULT_CHUNK = 128

_assumed = threading.local()


@dataclasses.dataclass(frozen=True)
class Target:
    """The device a program is compiled for: JAX's ``platform`` (``"cpu"``, ``"gpu"``,
    ``"tpu"``) and ``device_kind`` (e.g. ``"TPU v5 lite"``, ``"NVIDIA H100 80GB HBM3"``)."""

    platform: str
    device_kind: str


def target() -> Target:
    """The device the program being traced will run on: an :func:`assume`d one, else the
    active distribution's first device (a TPU topology's under ``kdist plan --device
    tpu-v5e`` on a CPU), else JAX's first device. Choices made while tracing that depend on
    the hardware ask this, never ``jax.default_backend()``, so a program compiled ahead of
    time for another platform makes that platform's choices.

    Example:
        >>> target().platform  # on a CPU machine
        'cpu'
    """
    assumed = getattr(_assumed, "target", None)
    if assumed is not None:
        return assumed
    import jax
    import keras

    dist = keras.distribution.distribution()
    device = dist.device_mesh.backend_mesh.devices.flat[0] if dist is not None \
        else jax.devices()[0]
    return Target(device.platform, device.device_kind)


@contextlib.contextmanager
def assume(device_kind: str, platform: str | None = None):
    """Trace as if for ``device_kind`` (e.g. ``"TPU v5 lite"``): the choices of this
    module follow it, e.g. to compile a TPU's step ahead of time on a CPU.

    Example:
        >>> with assume("TPU v5 lite"):
        ...     target()
        Target(platform='tpu', device_kind='TPU v5 lite')
    """
    if platform is None:
        platform = "tpu" if device_kind.lower().startswith("tpu") else "gpu"
    previous = getattr(_assumed, "target", None)
    _assumed.target = Target(platform, device_kind)
    try:
        yield _assumed.target
    finally:
        _assumed.target = previous


def check_implementation(name: str) -> str:
    """``name`` if it is one of :data:`ATTENTION_IMPLEMENTATIONS`, else a ``ValueError``."""
    if name not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"Unknown attention_implementation {name!r}. Use one of "
                         f"{ATTENTION_IMPLEMENTATIONS} ('auto': chosen by the device).")
    return name


def attention_for(device: Target, *, queries: int, keys: int, head_dim: int,
                  arbitrary_mask: bool, chunk_size: int | None, groups: int = 1) -> str:
    """What ``attention_implementation="auto"`` runs for these shapes on ``device``.

    ``arbitrary_mask``: a mask other than causality and documents (e.g. BERT's padded
    keys), which neither Pallas kernel takes. ``chunk_size``: the model's
    ``attention_chunk_size`` (a request for ``"chunked"`` where no kernel is faster).
    ``groups``: query heads per key/value head.

    On a TPU: kdist's flash kernels where an example's heads fit them whole, splash beyond
    (long sequences); inside kdist's per-device regions, where no Pallas kernel runs,
    chunked attention. Measured on a TPU v5e (``benchmarks/attention.py``,
    forward + backward, causal, bfloat16; ``benchmarks/results/attention_flash.json``):
    flash takes 0.78x, 0.80x and 0.92x splash's time at gpt2-small's, gpt2-medium's and a
    Llama-style shape, 0.30-0.40x XLA's.
    """
    if device.platform == "tpu" and not arbitrary_mask:
        from kdist.parallel import region

        if region.current().per_device:  # no Pallas kernel in a kdist region (JAX 0.10)
            return "chunked"
        if flash_supports(queries, keys, head_dim, groups,
                          flash_blocks(device, queries=queries, head_dim=head_dim)):
            return "flash"
        if supports(queries, keys, head_dim):
            return "splash"
    return "chunked" if chunk_size else "xla"


def splash_blocks(device: Target, *, queries: int, head_dim: int) -> Blocks:
    """Splash's tile sizes on ``device``: 1024 x 1024 with the fused backward kernel.

    Measured on a TPU v5e (``benchmarks/attention.py``, forward + backward, causal,
    bfloat16; ``benchmarks/results/attention.json``): against XLA's attention, 0.50x the
    time at gpt2-small's shape (batch 16, T 1024, 12 x 64 heads), 0.49x at gpt2-medium's
    (8, 1024, 16 x 64) and 0.31x at the Llama-style (4, 2048, 12 query / 4 key-value x 128
    heads) — within 3 % of the best tiling measured at each, where 128-token tiles (splash's
    own default) took 1.6-2.1x XLA's time and an unfused backward 10-18 % more. Shorter
    sequences take tiles of their whole length (a multiple of 128). Other TPUs use the
    same tiles (not measured on them)."""
    return Blocks(1024, 1024, fused=True)


def flash_blocks(device: Target, *, queries: int, head_dim: int) -> FlashBlocks:
    """Tile sizes of kdist's flash kernels on ``device``: 512-query tiles over 512-key
    chunks in both passes (clipped to shorter sequences).

    Measured on a TPU v5e (``benchmarks/attention.py``; forward + backward): the fastest of
    nine tilings at gpt2-small's (16, 1024, 12 x 64), gpt2-medium's (8, 1024, 16 x 64) and
    the Llama-style (4, 2048, 12/4 x 128) shapes, or within 2 % of it; 256-key chunks took
    13-19 % longer, 1024-query tiles 1-6 %. Other TPUs use the same tiles (not measured)."""
    return FlashBlocks()


def device_memory(device: Target | None = None) -> int | None:
    """Bytes of memory of one device of ``device``'s kind (default: :func:`target`): JAX's
    own figure for this process's devices (``memory_stats()["bytes_limit"]``: what XLA may
    allocate), else the accelerator table's HBM; None for a CPU or an unknown device."""
    import jax

    from kdist.accelerators.table import for_device_kind

    device = device or target()
    if device.platform == "cpu":
        return None
    for d in jax.local_devices():  # memory_stats() answers for this process's devices only
        if d.platform == device.platform and d.device_kind == device.device_kind:
            limit = (d.memory_stats() or {}).get("bytes_limit")
            if limit:
                return int(limit)
    chip = for_device_kind(device.device_kind) if device.platform != "cpu" else None
    return chip.hbm_bytes if chip is not None else None


def step_bytes(cost, mesh: dict[str, int], batch: int, length: int, remat) -> float:
    """One device's bytes of a training step with AdamW: float32 weights and both moments
    of its shard (and the gradients, but on a TPU), and what the backward pass keeps of its
    tokens under the rematerialisation policy ``remat`` (the cost model's estimate for the
    target device)."""
    shards = mesh.get("fsdp", 1) * mesh.get("model", 1)
    replicas = mesh.get("replica", 1) * mesh.get("data", 1) * mesh.get("fsdp", 1)
    tokens = batch / replicas * length / mesh.get("seq", 1)
    fused = target().platform == "tpu"  # what its compiler keeps (GPTCostModel)
    per_token = cost.activation_bytes_per_token(
        length, 2, remat=remat, scores_kept=attention_keeps_scores(cost.config, length),
        fused=fused)
    # Weights and both moments; the gradients too where the compiler does not consume each
    # as the backward pass makes it (a TPU's does: measured, see GPTCostModel).
    state = (3 if fused else 4) * 4 * cost.parameters / shards
    return state + tokens * per_token / mesh.get("model", 1)


def attention_of(config: dict, length: int) -> str:
    """The attention a model of ``config`` runs on the target device at ``length`` tokens
    (``"xla"``, ``"chunked"``, ``"splash"`` or ``"flash"``): its own setting, or what
    ``"auto"`` resolves to there."""
    name = config.get("attention_implementation", "auto")
    if name == "auto":
        heads = config["num_heads"]
        name = attention_for(target(), queries=length, keys=length,
                             head_dim=config.get("head_dim") or config["hidden_dim"] // heads,
                             arbitrary_mask=False,
                             chunk_size=config.get("attention_chunk_size"),
                             groups=heads // (config.get("num_key_value_heads") or heads))
    return name


def attention_keeps_scores(config: dict, length: int) -> bool:
    """Whether a model of ``config`` keeps ``(B, N, T, T)`` attention probabilities for the
    backward pass on the target device (XLA's attention does; chunked, splash and flash do
    not)."""
    return attention_of(config, length) == "xla"


# Of a device's memory, the share a step may plan on: XLA's own reservations, the
# program's code and fragmentation take the rest.
USABLE_MEMORY = 0.9
# The policies "auto" tries, least recompute first (kdist.models.remat).
REMAT_ORDER = (False, "minimal", "save_dots", "block")


# Batches per device of a preset's shape on a device, where they were measured: the
# largest whose step, compiled for the chip by its own compiler, fits without
# rematerialisation (XLA's memory analysis, ahead of time on a CPU, and run there), and
# the fastest of those measured (benchmarks/results/accelerator_tpu_v5e.json):
# (device kind, preset, sequence length) -> (fits, fastest). A model of a preset's exact
# shape takes them; any other model the estimate (step_bytes), which is more cautious:
# XLA keeps less than the cost model's count.
COMPILED_FITS = {
    # 7.7 GiB, 149.7k tokens/s at 16 (flash kernels with heads as (H, T), 2026-12-07;
    # accelerator_tpu_v5e_ht.json). Batch 32 fits too (8.3 GiB compiled with the first
    # kernel); its speed unmeasured.
    ("TPU v5 lite", "gpt2-small", 1024): (16, 16),
    # Batch 8: 9.9 GiB, 54.1k tokens/s (heads as (H, T)); 16 fits (14.9 GiB with the kernels
    # before) and was slower then (43.0k against 47.6k at 8); not measured since.
    ("TPU v5 lite", "gpt2-medium", 1024): (16, 8),
    # 12.1 GiB, 37.1k tokens/s (heads as (H, T)); batch 8 needs rematerialisation
    # ("minimal": 16.9 GB).
    ("TPU v5 lite", "llama-550m", 2048): (4, 4),
}


def _cost(model):
    """The cost model of a task (``cost_model()``) or a cost model itself."""
    return model.cost_model() if hasattr(model, "cost_model") else model


def compiled_fit(model, length: int, fastest: bool = False) -> int | None:
    """The largest batch per device (``fastest``: the fastest) :data:`COMPILED_FITS` holds
    for ``model`` (a task or its cost model) at ``length`` on the target device, or None
    (no entry: another device, shape or option)."""
    cost = _cost(model)
    config = getattr(cost, "config", None) or {}
    # Measured at these settings only (a quantized step's temporaries are not measured).
    neutral = {"remat": "auto", "attention_implementation": "auto", "attention_chunk_size": None,
               "scan_layers": False, "dropout": 0.0, "document_mask": False,
               "matmul_precision": "bf16"}
    if not config or any(config.get(k, v) != v and not (k == "scan_layers" and
                                                         config.get(k) is None)
                         for k, v in neutral.items()):
        return None
    kind = target().device_kind.lower()
    name = cost.preset() if hasattr(cost, "preset") else None  # (a GPT cost model's)
    return next((batches[fastest] for (k, p, t), batches in COMPILED_FITS.items()
                 if (k.lower(), p, t) == (kind, name, length)), None)


def remat_for(model, batch: int, length: int):
    """What ``remat="auto"`` means for ``model``'s training step on ``batch`` sequences of
    ``length`` tokens: on an accelerator, no rematerialisation where the step was compiled
    for the device and fit (:data:`COMPILED_FITS`), else the policy with the least
    recompute whose step the cost model fits in the device's memory; on a CPU (or where the
    memory is unknown, or under a pipeline, whose schedule bounds its activations)
    ``False``."""
    from kdist.parallel.layout import current_mesh_shape

    memory = device_memory()
    mesh = current_mesh_shape()
    cost = _cost(model)
    if memory is None or mesh.get("stage", 1) > 1 or not hasattr(cost, "config"):
        return False
    fit = compiled_fit(model, length)
    replicas = mesh.get("replica", 1) * mesh.get("data", 1) * mesh.get("fsdp", 1)
    if fit is not None and batch <= fit * replicas:
        return False
    for policy in REMAT_ORDER:
        if step_bytes(cost, mesh, batch, length, policy) <= USABLE_MEMORY * memory:
            return policy
    return "block"


def remat_for_data(model, data):
    """:func:`remat_for` of a training batch ``data`` (``(x, y[, w])``; ``x`` token ids
    ``(B, T)`` or a dict of them)."""
    x = data[0] if isinstance(data, (tuple, list)) else data
    import jax

    first = jax.tree.leaves(x)[0]
    return remat_for(model, first.shape[0], first.shape[1]) if first.ndim >= 2 else False


def default_batch(model, sequence_length: int) -> int:
    """Sequences per step the recipes and benchmarks train ``model`` (a task or its cost
    model) with on the target device: :data:`COMPILED_FITS`' fastest for a preset's shape,
    else the largest power-of-two multiple of the batch axes whose step the estimate fits
    in the device's memory without
    rematerialisation (:func:`step_bytes`), else with ``"minimal"``; on a CPU, or where the
    device's memory is unknown, 8 per replica."""
    from kdist.parallel.layout import current_mesh_shape

    mesh = current_mesh_shape()
    replicas = mesh.get("replica", 1) * mesh.get("data", 1) * mesh.get("fsdp", 1)
    memory = device_memory()
    if memory is None:
        return 8 * replicas
    fit = compiled_fit(model, sequence_length, fastest=True)
    if fit is not None:
        return fit * replicas
    cost = _cost(model)
    for policy in REMAT_ORDER[:2]:
        fitting = [replicas * 2**i for i in range(10) if step_bytes(
            cost, mesh, replicas * 2**i, sequence_length, policy) <= USABLE_MEMORY * memory]
        if fitting:
            return fitting[-1]
    return replicas
