"""The region being traced: which mesh axes are manual here, how rows and tokens are split.

Every per-device computation of kdist — DiLoCo's replica groups, the per-device loss of
the explicit gradient reduction, a pipeline's stages, attention over a split sequence —
is a ``jax.shard_map`` body, and they nest: a pipeline inside a replica group, ring
attention inside a stage, the per-device loss inside both. JAX refuses to make an axis
manual that an enclosing ``shard_map`` already made manual, so each builder asks the
:class:`Region` in scope for the axes it needs that are still automatic
(:func:`shard_map` does), and code inside reads what the region says instead of guessing:
whether an array is one device's block (:attr:`Region.manual`), over which manual axes its
rows are split (:attr:`Region.batch_axes`, for dropout's row offsets), and the step's
token layout under a ``seq`` axis (:attr:`Region.sequence`).

Outside every region :func:`current` is ``Region()``: nothing manual, whole arrays.

Example:
    >>> current().manual
    frozenset()
    >>> with entered(current().within({"data"}, batch_axes=("data",))):
    ...     current().manual, current().batch_axes
    (frozenset({'data'}), ('data',))
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading

from kdist.parallel import mesh as _mesh

_stack = threading.local()


@dataclasses.dataclass(frozen=True)
class Region:
    """What holds while a computation is traced.

    Args:
        manual: the mesh axes manual here (every enclosing ``shard_map``'s).
        batch_axes: the manual axes the rows are split over, in the batch layout's order
            (outermost first): a device's rows are block ``axis_index(batch_axes)``.
        sequence: the token layout the training step set under a ``seq`` axis
            (:class:`kdist.parallel.context.token_layout.SequenceLayout`), or None.
    """

    manual: frozenset = frozenset()
    batch_axes: tuple[str, ...] = ()
    sequence: object = None

    @property
    def per_device(self) -> bool:
        """Whether arrays here are per-device blocks over some axes."""
        return bool(self.manual)

    @property
    def tokens_split(self) -> bool:
        """Whether each device here holds its own share of every sequence's tokens."""
        return "seq" in self.manual

    def automatic(self, axes) -> frozenset:
        """Those of ``axes`` that are still automatic here."""
        return frozenset(axes) - self.manual

    def within(self, axes, batch_axes=()) -> Region:
        """The region inside a ``shard_map`` over ``axes`` (those not manual yet) here,
        whose rows are split over ``batch_axes`` as well."""
        batch = {*self.batch_axes, *batch_axes}
        return dataclasses.replace(
            self, manual=self.manual | frozenset(axes),
            batch_axes=_mesh.batch_axes(None, among=batch))

    def with_sequence(self, layout) -> Region:
        return dataclasses.replace(self, sequence=layout)


def current() -> Region:
    """The region being traced (``Region()`` outside every one)."""
    stack = getattr(_stack, "regions", None)
    return stack[-1] if stack else Region()


@contextlib.contextmanager
def entered(region: Region):
    """Traces the body in ``region`` (the innermost of the regions entered)."""
    stack = getattr(_stack, "regions", None)
    if stack is None:
        stack = _stack.regions = []
    stack.append(region)
    try:
        yield region
    finally:
        stack.pop()


def shard_map(fn, *, mesh, axes, in_specs, out_specs, batch_axes=(), check_vma=True):
    """``jax.shard_map(fn)`` over those of ``axes`` still automatic in the current region,
    ``fn`` traced in the region inside (:meth:`Region.within`); ``fn`` itself when none
    is. ``mesh``: the distribution's JAX mesh (a nested ``shard_map`` takes the enclosing
    one's). ``in_specs``/``out_specs`` may name only those axes. ``check_vma=False``:
    JAX does not type what varies over the manual axes (for a body whose operations cannot,
    such as a Pallas kernel's; only outside every other region).

    Nested in another region the result is differentiable all the same: JAX 0.10 cannot
    differentiate a ``shard_map`` nested in another (the residuals it ships name the outer
    manual axes), so there the gradient is taken inside, by ``jax.vjp``, and its residuals
    leave the ``shard_map`` per device (:func:`_differentiable`).

    Example:
        >>> f = shard_map(lambda x: x * 2, mesh=mesh, axes={"data"},  # doctest: +SKIP
        ...               in_specs=P("data"), out_specs=P("data"))
    """
    import jax

    outer = current()
    new = outer.automatic(axes)
    inner = outer.within(new, batch_axes)

    def body(*args):
        with entered(inner):
            return fn(*args)

    if not new:  # every axis asked for is manual already: the arrays are blocks
        return body
    if not check_vma and outer.per_device:
        raise ValueError("A shard_map without varying-axes checks cannot nest in another "
                         "region (its axes would be typed as not varying).")
    mapped = functools.partial(jax.shard_map, mesh=None if outer.per_device else mesh,
                               axis_names=set(new), check_vma=check_vma)
    if not outer.per_device:
        return mapped(body, in_specs=in_specs, out_specs=out_specs)
    return _differentiable(body, mapped, in_specs, out_specs, tuple(sorted(new)))


def _differentiable(body, mapped, in_specs, out_specs, axes):
    """``mapped(body)`` with a ``custom_vjp`` whose forward pass runs ``jax.vjp(body)``
    inside the ``shard_map`` and returns its residuals, each stacked on a leading axis over
    the new manual axes it varies over (a first, abstract trace finds them: the backward
    pass must see every residual with the type it had); the backward pass hands them to a
    second ``shard_map`` that applies the vjp. Integer inputs get no cotangent."""
    import jax
    from jax.sharding import PartitionSpec as P


    saved = {}

    def traced(stack):
        def forward(*args):
            out, vjp = jax.vjp(body, *args)
            leaves, saved["tree"] = jax.tree.flatten(vjp)
            saved["varying"] = [varying_axes(leaf) & set(axes) for leaf in leaves]
            return out, [stack(leaf)[None] for leaf in leaves]
        return forward

    def backward(residuals, cotangent):
        vjp = jax.tree.unflatten(saved["tree"], [r[0] for r in residuals])
        return jax.tree.map(lambda g: None if g.dtype == jax.dtypes.float0 else g,
                            vjp(cotangent))

    @jax.custom_vjp
    def run(*args):
        return mapped(body, in_specs=in_specs, out_specs=out_specs)(*args)

    def run_fwd(*args):
        # Abstractly first (everything stacked over every axis) to learn the residuals'
        # types; then for real, each over the axes it varies over.
        jax.eval_shape(mapped(traced(lambda leaf: to_varying(leaf, axes)), in_specs=in_specs,
                              out_specs=(out_specs, P(axes))), *args)
        saved["specs"] = [P(tuple(a for a in axes if a in v) or None)
                          for v in saved["varying"]]
        return mapped(traced(lambda leaf: leaf), in_specs=in_specs,
                      out_specs=(out_specs, saved["specs"]))(*args)

    def run_bwd(residuals, cotangent):
        return mapped(backward, in_specs=(saved["specs"], out_specs),
                      out_specs=in_specs)(residuals, cotangent)

    run.defvjp(run_fwd, run_bwd)
    return run


def varying_axes(x) -> frozenset:
    """The manual axes over which ``x`` may differ between devices (JAX's type of it)."""
    import jax

    aval = jax.typeof(x)
    return aval.vma if hasattr(aval, "vma") else aval.manual_axis_type.varying  # jax >= 0.9


def to_varying(x, axes):
    """``x`` typed as varying over ``axes`` too (a scan's initial carry must have the type
    of the carry it returns; outside ``shard_map`` there are no axes and nothing changes)."""
    import jax

    missing = tuple(sorted(set(axes) - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def stackable(x):
    """``x`` as a region's per-device output stacked over devices: a scalar (a pipeline
    schedule's loss, standing in for predictions no metric reads:
    :mod:`kdist.parallel.pipeline.transform`)
    as shape ``(1, 1)`` (stacked over rows and, under a split sequence, tokens), anything
    else as it is (its rows are the device's)."""
    return x.reshape((1, 1)) if not x.ndim else x
