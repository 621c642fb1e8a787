"""The planner's figures of a Mixture-of-Experts model: its routed experts' weights split
over the ``expert`` mesh axis, the dispatch buffers and per-expert activations a device
keeps, and the two all-to-alls per MoE layer each way (:mod:`kdist.parallel.experts`).

Shapes on one device, with the cost model's :class:`~kdist.models.cost.Experts` (L MoE
layers of E experts, k per token, width D, expert width F), n the device's tokens, e the
``expert`` axis size and C the slots per expert and source device:

* weights: the routed experts' ``3 D F E`` per layer carry the logical axes
  ``(expert, embed, mlp)`` (:mod:`kdist.parallel.rules`: ``expert -> expert``,
  ``embed -> fsdp``, ``mlp -> model``), so a device holds ``1/(e f m)`` of them and
  ``1/(f m)`` of every other weight (the router ``(D, E)`` is ``(embed, None)``);
* rows: each device packs its ``n k`` assignments into an ``(E, C, D)`` buffer, ``C = n k``
  for a dropless layer under an ``expert`` axis (nothing can overflow, at E x the rows),
  ``C = ceil(factor n k / E)`` with a ``capacity_factor``; without the axis a dropless
  layer computes its ``n k`` rows with grouped matmuls (:func:`rows`);
* traffic: the buffer goes to the experts' devices and the outputs come back (two
  ``all_to_all`` over ``expert`` forward, their transposes backward): ``4 ring(e) E C D``
  value bytes per layer per step (:func:`all_to_all_terms`); beside a ``model`` axis the
  experts' rows are all-reduced over it (:func:`model_axis_terms`);
* kdist's gradient reduction: the experts padded to the whole shape in its per-device
  loss, and what XLA keeps of them (:func:`padded_gradient_bytes`); a pipeline's stages:
  :mod:`kdist.planning.stages` and :mod:`kdist.planning.schedule_memory`.

Example:
    >>> from kdist.planning.estimate import cost_model_of
    >>> ex = cost_model_of("gpt-nano-moe").experts
    >>> rows(ex, 128, expert_axis=2), rows(ex, 128, expert_axis=1)  # E n k, n k
    (8192, 512)
"""

from __future__ import annotations

from collections.abc import Mapping

from kdist.models.cost import Experts
from kdist.parallel.experts import capacity
from kdist.planning import traffic


def routed_parameters(cost) -> int:
    """The routed experts' weights of ``cost`` (what the ``expert`` axis splits); 0 for a
    dense model or a cost model that does not state its experts."""
    experts = getattr(cost, "experts", None)
    return experts.parameters if experts else 0


def weight_values(cost, mesh: Mapping[str, int]) -> float:
    """Weights a device holds (values, not bytes): ``P_dense / (f m) + P_routed / (e f m)``
    (see the module docstring for the rules that split them)."""
    shards = mesh.get("fsdp", 1) * mesh.get("model", 1)
    routed = routed_parameters(cost)
    return (cost.parameters - routed) / shards + routed / (shards * mesh.get("expert", 1))


def rows(experts: Experts, tokens: float, expert_axis: int) -> float:
    """Rows one MoE layer's experts compute on a device of ``tokens`` tokens: the
    ``(E, C, D)`` buffer's ``E x C`` (the all-to-all's capacity: ``C = n k`` dropless
    under an ``expert`` axis, ``ceil(factor n k / E)`` with a ``capacity_factor``), or
    ``n k`` for a dropless layer without the axis (grouped matmuls, no padding)."""
    assignments = tokens * experts.experts_per_token
    if experts.capacity_factor is not None:
        return experts.num_experts * capacity(int(assignments), experts.num_experts,
                                              experts.capacity_factor)
    return experts.num_experts * assignments if expert_axis > 1 else assignments


def activation_bytes(cost, tokens: float, value_bytes: int, remat,
                     expert_axis: int, model_axis: int = 1,
                     layers: float | None = None) -> float:
    """What the MoE layers add to the dense cost model's activations on a device of
    ``tokens`` tokens, in bytes. Per MoE layer kept for the backward pass: the rows
    each expert received ``R x D`` (R: :func:`rows`), its gate and up projections and
    their SwiGLU product ``R x 3F`` (GELU experts: ``R x 2F``), the ``n k x D`` outputs the
    router's weights combine, and the shared experts' as a dense MLP's of their width;
    plus, once, what one layer's backward holds beside them: the ``(E, C, D)``
    buffers in flight (the one sent and the one received, ``2 R x D``) and the gradients
    of its three ``R x F`` intermediates (``3 R x F``; without them the compiled
    ``expert=2,data=4`` gpt-nano-moe step of 2 layers, batch 16 x 64, was 0.90 of its
    peak, with them 1.00). The dense MLP the cost model counted for those layers
    (``F_mlp`` and its activation per token) is taken out. Per-block remat keeps one
    layer's set; ``layers``: the MoE layers whose set is kept (default: all; a pipeline
    stage's chunk, :mod:`kdist.planning.stages`); 0 for a dense model.

    Under a ``model`` axis of ``m`` (left to XLA in the experts' region) every ``F``-wide
    value is split ``m`` ways and the ``R x D`` rows are whole on each device, three of
    them per layer: the rows received, the down projection's partial sums and their
    all-reduced sum (``R (3 D + 3 F / m)``). The compiled ``expert=2,model=2,data=2``
    gpt-nano-moe steps (batch 16 x 64) peak at 76.7 MiB with 2 layers and 142.9 with 4,
    estimated 81.2 and 144.5 (1.06, 1.01; with the rows kept once, 0.95 and 0.84)."""
    experts = getattr(cost, "experts", None)
    if not experts or not tokens:
        return 0.0
    c = getattr(cost, "config", {})
    kept = remat in (False, True, "block")  # the cost model's `everything`: activations too

    def mlp(width, gated):  # a dense MLP's values per token (the cost model's count)
        return width * (2 if gated else 1) + (width if kept else 0)

    dense_mlp = mlp(c.get("intermediate_dim", 0), c.get("mlp_activation") == "swiglu")
    shared_mlp = mlp(experts.shared_dim, experts.matrices == 3)
    r, m = rows(experts, tokens, expert_axis), model_axis
    d, f, n = experts.hidden_dim, experts.expert_dim, experts.matrices
    per_layer = (r * (d * (1 if m == 1 else 3) + n * f / m)
                 + tokens * experts.experts_per_token * d
                 + tokens * (shared_mlp - dense_mlp) / m)
    layers = 1 if remat in (True, "block") else experts.layers if layers is None else layers
    backward = r * (2 * d + n * f / m)
    return value_bytes * (layers * per_layer + backward)


def gathered_bytes(cost, mesh: Mapping[str, int]) -> float:
    """The routed experts' float32 weights and gradients a device holds whole over
    ``fsdp`` under an ``expert`` axis: the dispatch's region is manual over the batch's
    axes, fsdp among them, so a MoE layer's ``E/e`` experts enter it gathered and their
    gradients leave it whole (summed over fsdp on the way out) — one layer's at a time
    (the program gathers them again for the backward pass): ``2 x 4 P_e/(e m L)`` bytes in
    the temporaries. The compiled ``expert=2,fsdp=4`` gpt-nano-moe step of 2 layers, batch
    16 x 64: dropless 61.80 MiB, estimated 53.91 (46.03 without them); with
    ``capacity_factor=1.25`` 30.25, estimated 27.23. 0 without ``fsdp`` or ``expert``."""
    e, f = mesh.get("expert", 1), mesh.get("fsdp", 1)
    if e == 1 or f == 1:
        return 0.0
    layers = cost.experts.layers
    return 2 * 4 * routed_parameters(cost) / (e * mesh.get("model", 1) * layers)


def padded_gradient_bytes(cost, mesh: Mapping[str, int], reduction: str | None) -> float:
    """What kdist's per-device loss (a ``gradient_reduction``) adds under an ``expert``
    axis: each device's experts enter it padded with zeros to the whole weight's shape
    (:func:`kdist.parallel.experts.as_whole`, for Keras), and its gradient is taken of the
    whole shape. XLA does not keep the zeros (measured: no whole-shape buffer of the
    experts lives at the peak), but holds the device's experts' float32 gradient a
    second time, ``4 P_e / (e f m)`` bytes: the compiled gpt-nano-moe steps (batch
    16 x 64) with ``gradient_reduction="float32"`` peak at +7.2 MiB (2 layers) and
    +15.0 MiB (4 layers) over the same ``expert=2,data=4`` step without it, this term
    7.9 and 15.8; ``expert=4,data=2`` +2.8 (3.9). An 8-bit ``reduction`` (``"int8"``,
    ``"float8"``: :mod:`kdist.parallel.compression`) keeps the whole shape's gradient,
    zeros included, ``4 P_e / m`` more: with ``"int8"`` the same 2-layer steps on
    ``expert=2,data=4`` and ``expert=2,fsdp=4`` peak 15.75 MiB over ``"float32"``'s,
    this term's exactly. 0 without an ``expert`` axis or a ``reduction``."""
    e, m = mesh.get("expert", 1), mesh.get("model", 1)
    if e == 1 or not reduction:
        return 0.0
    routed = routed_parameters(cost)
    whole = 4 * routed / m if reduction in ("int8", "float8") else 0.0
    return 4 * routed / (e * mesh.get("fsdp", 1) * m) + whole


def all_to_all_terms(cost, mesh: Mapping[str, int], tokens: float,
                     value_bytes: int) -> list[traffic.Traffic]:
    """The all-to-alls over ``expert`` per (micro-)step of a device of ``tokens`` tokens:
    per MoE layer, the dispatch and the combine forward and their transposes backward,
    each ``ring(e) x E C D`` value bytes (the ``(E, C, D)`` buffer, ``E x C`` =
    :func:`rows`, of which the device keeps ``1/e``). None without an ``expert`` axis."""
    experts, e = getattr(cost, "experts", None), mesh.get("expert", 1)
    if not experts or e == 1:
        return []
    buffer = rows(experts, tokens, e) * experts.hidden_dim * value_bytes
    return [traffic.Traffic("all-to-all", ("expert",),
                            4 * experts.layers * (e - 1) / e * buffer)]


def model_axis_terms(cost, mesh: Mapping[str, int], tokens: float,
                     value_bytes: int) -> list[traffic.Traffic]:
    """What a ``model`` axis adds to the tensor-parallel all-reduces of a MoE layer under
    an ``expert`` axis, per (micro-)step of a device of ``tokens`` tokens: the experts'
    ``F`` split over ``model``, the down projection's ``R x D`` partial sums are
    all-reduced forward and the gate's and up projection's input gradients, ``2 R x D``
    side by side (XLA sums them after), backward — in place of the dense MLP's two of
    ``n x D`` that :func:`kdist.planning.estimate.collective_terms` counts per layer:
    ``2 ring(m) (3 R - 2 n) D`` value bytes per MoE layer. The compiled
    ``expert=2,model=2,data=2`` gpt-nano-moe step (2 layers, batch 16 x 64) moves 27.9 MiB
    over ``model``, 25.5 MiB estimated (XLA also all-reduces the experts' weight
    gradients, 3.9 MiB, over it). None without both axes."""
    experts, e, m = getattr(cost, "experts", None), mesh.get("expert", 1), mesh.get("model", 1)
    if not experts or e == 1 or m == 1:
        return []
    r = rows(experts, tokens, e)
    return [traffic.Traffic("all-reduce", ("model",), 2 * (m - 1) / m * experts.layers
                            * (3 * r - 2 * tokens) * experts.hidden_dim * value_bytes)]


def stage_block_values(parts: Mapping[str, float], expert_axis: int) -> float:
    """The blocks' weights (values) a pipeline stage's device holds before ``stage``,
    ``fsdp`` and ``model`` split them (``parts``: :func:`kdist.planning.stages.split`):
    the routed experts' ``1/e`` (each device its own experts; in a stage's layers they
    are padded to the whole shape one layer at a time,
    :func:`kdist.parallel.experts.as_whole`, and what lives across the step, the weights,
    Adam's state and the gradient accumulated over the ticks, is the device's share)."""
    routed = parts.get("routed_parameters", 0.0)
    return parts["block_parameters"] - routed + routed / expert_axis


def expert_sizes(cost, devices: int) -> list[int]:
    """The ``expert`` axis sizes the search tries over ``devices``: 1, and for a model with
    routed experts each size > 1 dividing both the experts and the devices.

    Example:
        >>> from kdist.planning.estimate import cost_model_of
        >>> [expert_sizes(cost_model_of(name), 8) for name in ("gpt-nano-moe", "gpt-nano")]
        [[1, 2, 4, 8], [1]]
    """
    experts = getattr(cost, "experts", None)
    if not experts:
        return [1]
    return [1] + [e for e in range(2, devices + 1)
                  if devices % e == 0 and experts.num_experts % e == 0]
