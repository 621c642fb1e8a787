"""The schedule interpreter (kdist/parallel/interpreter.py) on 8 host devices: every
schedule's loss and gradients equal one device's autodiff of the same layers (float32,
rtol 2e-6); the gradient reaches what computed the inputs (an embedding) through the
enclosing jax.grad; 1F1B's buffers hold S microbatches where GPipe's hold M, seen in the
compiled program's memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kdist.parallel.pipeline import every_stage, interpreter, schedule_region, schedules
from kdist.parallel.pipeline.settings import bubble_fraction
from kdist.parallel.region import to_varying

LAYERS_PER_CHUNK, WIDTH, ROWS, LENGTH = 2, 8, 32, 4


def layer(w, b, h):  # (rows, T, D) -> (rows, T, D)
    return jnp.tanh(h @ w + b)


def stage_fn(w, h, data, chunk):
    """This device's layers of one chunk; the position input shows per-microbatch data."""
    h = h + data["shift"][..., None]

    def body(h, wb):
        return layer(wb[0], wb[1], h), None

    return jax.lax.scan(body, h, (w[0], w[1]))[0]


def loss_fn(head, y, data):  # this microbatch's share of the mean squared error
    return jnp.sum((y @ head - data["target"]) ** 2) / ROWS


def problem(stages, chunks, seed=0):
    layers = stages * chunks * LAYERS_PER_CHUNK
    rng = np.random.default_rng(seed)
    def f32(*shape, scale=1.0):
        return (rng.normal(size=shape) * scale).astype(np.float32)
    return dict(W=f32(layers, WIDTH, WIDTH, scale=WIDTH ** -0.5),
                b=f32(layers, WIDTH, scale=0.1), head=f32(WIDTH, 3), table=f32(11, WIDTH),
                tokens=rng.integers(0, 11, (ROWS, LENGTH)),
                shift=f32(ROWS, LENGTH, scale=0.1), target=f32(ROWS, LENGTH, 3))


def mesh_of(stages):
    return jax.make_mesh((stages, 8 // stages), ("stage", "data"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)


def one_device(p):
    """Loss and gradients (W, b, head, table) of the plain model, by autodiff."""
    def loss(W, b, head, table):
        h = table[p["tokens"]]
        for i in range(len(W)):
            h = layer(W[i], b[i], h + p["shift"][..., None] if i % LAYERS_PER_CHUNK == 0 else h)
        return jnp.sum((h @ head - p["target"]) ** 2) / ROWS

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(
        p["W"], p["b"], p["head"], p["table"])


def microbatches(a, groups, m):
    """(B, ...) -> (M, B / M, ...): each replica group's rows cut into M, as
    kdist.parallel.pipeline does."""
    rows = a.shape[0] // (groups * m)
    return a.reshape((groups, m, rows) + a.shape[1:]).swapaxes(0, 1).reshape(
        (m, groups * rows) + a.shape[1:])


def scheduled(p, name, stages, m, chunks, every_stage=False):
    """Loss and the same gradients, the embedding outside the schedule."""
    groups = 8 // stages
    mesh = mesh_of(stages)
    def put(a, *spec):
        return jax.device_put(a, NamedSharding(mesh, P(*spec)))
    table = schedules.build(name, stages, m, chunks)
    weights = [put(p["W"].reshape((chunks, -1) + p["W"].shape[1:]), None, "stage"),
               put(p["b"].reshape((chunks, -1) + p["b"].shape[1:]), None, "stage")]
    data = {k: put(microbatches(p[k], groups, m), None, "data") for k in ("shift", "target")}
    tokens = put(microbatches(p["tokens"], groups, m), None, "data")

    def loss(weights, head, embedding):
        xm = embedding[tokens]  # (M, b, T, D)
        return schedule_region.scheduled_loss(table, stage_fn, loss_fn, weights, head, xm, data,
                                          mesh=mesh, batch_axes=("data",),
                                          every_stage=every_stage)

    value, (d_w, d_head, d_table) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(
        weights, p["head"], p["table"])
    return value, (np.asarray(d_w[0]).reshape(p["W"].shape),
                   np.asarray(d_w[1]).reshape(p["b"].shape), d_head, d_table)


CASES = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("gpipe", 4, 8, 2),
         ("interleaved_1f1b", 4, 8, 2), ("1f1b", 2, 4, 1), ("interleaved_1f1b", 2, 4, 3),
         ("zero_bubble", 4, 8, 1), ("zero_bubble", 2, 4, 1)]


@pytest.mark.parametrize("name, stages, m, chunks", CASES)
def test_every_schedule_trains_like_one_device(name, stages, m, chunks):
    p = problem(stages, chunks)
    want_loss, want = one_device(p)
    got_loss, got = scheduled(p, name, stages, m, chunks)
    np.testing.assert_allclose(got_loss, want_loss, rtol=2e-6)
    for what, g, w in zip(("W", "b", "head", "embedding"), got, want):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-6 * float(np.abs(w).max()),
                                   err_msg=what)


@pytest.mark.parametrize("name, stages, m, chunks", [("1f1b", 4, 8, 1),
                                                     ("interleaved_1f1b", 2, 4, 3)])
def test_every_stage_running_each_tick_trains_like_one_device(name, stages, m, chunks):
    """Every stage runs each tick's kind of task, idle ones on zeros (what ring attention
    needs): the same loss and gradients, and a table that mixes kinds is refused."""
    p = problem(stages, chunks)
    want_loss, want = one_device(p)
    got_loss, got = scheduled(p, name, stages, m, chunks, every_stage=True)
    np.testing.assert_allclose(got_loss, want_loss, rtol=2e-6)
    for what, g, w in zip(("W", "b", "head", "embedding"), got, want):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-6 * float(np.abs(w).max()),
                                   err_msg=what)
    with pytest.raises(ValueError, match="'zero_bubble' runs ticks that mix forwards and"):
        every_stage.forward_ticks(interpreter.Program(schedules.build("zero_bubble", 4, 8)))
    with pytest.raises(ValueError, match="'1f1b' runs ticks that mix"):
        every_stage.forward_ticks(interpreter.Program(schedules.build("1f1b", 4, 8,
                                                                       mixed=True)))


def test_a_task_it_cannot_run_is_refused_before_compiling():
    """The interpreter runs F, B, I and W; an unknown task is refused by name."""
    table = schedules.build("1f1b", 2, 2)
    cells = list(table.cells)
    cells[0] = (schedules.Task("R", 0), cells[0][1])
    broken = schedules.Table("1f1b", 2, 2, 1, tuple(cells))
    with pytest.raises(ValueError, match="runs F, B, I and W tasks; got Task\\(action='R'"):
        interpreter.Program(broken)


@pytest.mark.parametrize("name, stages, m, chunks, slots", [
    ("gpipe", 4, 8, 1, 8), ("1f1b", 4, 8, 1, 5), ("1f1b", 4, 32, 1, 5),
    ("interleaved_1f1b", 4, 8, 2, 9), ("interleaved_1f1b", 4, 32, 2, 9),
    ("zero_bubble", 4, 8, 1, 4), ("zero_bubble", 4, 32, 1, 4)])
def test_buffers_hold_what_the_schedule_keeps_in_flight(name, stages, m, chunks, slots):
    """A stage's input buffer: its in-flight microbatches plus the one that arrived while it
    was busy; 1F1B's, interleaved's and zero-bubble's do not grow with M. Zero-bubble keeps
    a cotangent from its I to its W as well."""
    program = interpreter.Program(schedules.build(name, stages, m, chunks))
    assert program.input_slots == slots
    table = program.table
    assert program.input_slots <= table.max_in_flight() + 1
    if name == "zero_bubble":  # the cotangents between I and W, and one arriving
        assert program.cotangent_slots <= table.max_deferred() + 1


def autodiff_gpipe(stages, m, weights, head, xm, data):
    """Today's GPipe in miniature (kdist.parallel.pipeline): one scan over M + S - 1
    iterations, differentiated by JAX, which keeps every iteration's residuals."""
    s = jax.lax.axis_index("stage")
    w = [a[0] for a in weights]

    def step(carry, t):
        shift, loss = carry
        i = jnp.clip(t - s, 0, m - 1)
        data_i = jax.tree.map(lambda a: a[i], data)
        h = jnp.where(s == 0, xm[jnp.minimum(t, m - 1)], shift)
        y = stage_fn(w, h, data_i, 0)
        done = (s == stages - 1) & (t - s >= 0) & (t - s < m)
        loss = loss + jnp.where(done, loss_fn(head, y, data_i), 0.0)
        return (jax.lax.ppermute(y, "stage", [(j, j + 1) for j in range(stages - 1)]), loss), None

    init = jax.tree.map(lambda a: to_varying(a, ("data", "stage")),
                        (jnp.zeros_like(xm[0]), jnp.zeros(())))
    (_, loss), _ = jax.lax.scan(step, init, jnp.arange(m + stages - 1))
    return jax.lax.psum(loss, ("stage", "data"))


def temp_bytes(name, m, chunks=1, stages=4, rows=256, length=64, width=64, per_stage=4):
    """The compiled step's temporary bytes per device (global batch fixed: M splits it);
    ``name`` a schedule the interpreter runs, or ``"autodiff"`` for today's GPipe."""
    return compiled_step(name, m, chunks, stages, rows, length, width,
                         per_stage).memory_analysis().temp_size_in_bytes


def compiled_step(name, m, chunks=1, stages=4, rows=256, length=64, width=64, per_stage=4):
    """The compiled step (see :func:`temp_bytes`)."""
    mesh = mesh_of(stages)
    layers = stages * per_stage
    def sds(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
    weights = [sds((chunks, layers // chunks, width, width), P(None, "stage")),
               sds((chunks, layers // chunks, width), P(None, "stage"))]
    xm = sds((m, rows // m, length, width), P(None, "data"))
    data = {"shift": sds((m, rows // m, length), P(None, "data")),
            "target": sds((m, rows // m, length, 3), P(None, "data"))}
    head = jax.ShapeDtypeStruct((width, 3), jnp.float32)
    if name == "autodiff":
        def run(w, head, xm, data):
            loss = jax.shard_map(
                lambda w, head, xm, data: autodiff_gpipe(stages, m, w, head, xm, data),
                mesh=mesh, in_specs=([P(None, "stage")] * 2, P(), P(None, "data"),
                                     {k: P(None, "data") for k in data}), out_specs=P())
            return jax.value_and_grad(loss, argnums=(0, 1, 2))(w, head, xm, data)
    else:
        table = schedules.build(name, stages, m, chunks)

        def run(w, head, xm, data):
            return schedule_region.value_and_grad(table, stage_fn, loss_fn, w, head, xm, data,
                                              mesh=mesh, batch_axes=("data",))
    return jax.jit(run).lower(weights, head, xm, data).compile()


def test_each_task_costs_what_its_vjp_computes_and_ticks_wait_for_the_costliest():
    """The compiled tick's branches (kdist.hlo.branch_flops), in matmul FLOPs of one
    microbatch through a stage's K = 4 layers (F = K x 2 b T D^2): B recomputes the forward
    and computes both gradients (3 F); I the forward and the input's gradient (2 F); W the
    forward, the weights' gradients and, to reach every layer's weights, the input
    gradients again — of every layer, the first's too: the layers are a scan, whose
    backward body computes both for each (3 F). Splitting B costs zero-bubble 2 F more per
    microbatch than 1F1B's B.
    Every tick lasts as long as its costliest task: 1F1B's ticks run forwards only or
    backwards only, M + S - 2 and M + S - 1 of them, so its step lasts GPipe's
    (M + S - 1) (F + B) less one forward, and its bubble in time is the formula's."""
    from kdist import hlo

    stages, m, rows, length, width, per_stage = 4, 8, 256, 64, 64, 4
    text = compiled_step("zero_bubble", m, stages=stages).as_text()
    flops = hlo.branch_flops(text)
    F = per_stage * 2 * (rows // m // 2) * length * width * width  # b: a data shard's rows
    head = 2 * (rows // m // 2) * length * width * 3
    assert flops[interpreter.IDLE] == 0 and flops[interpreter.FORWARD] == F
    assert flops[interpreter.INPUT_GRAD] == 2 * F
    assert flops[interpreter.WEIGHT_GRAD] == flops[interpreter.BACKWARD] == 3 * F
    assert flops[interpreter.LAST_INPUT_GRAD] == 2 * F + 2 * head  # + the head's matmuls
    one_f = interpreter.Program(schedules.build("1f1b", stages, m))
    idle = float((one_f.action == interpreter.IDLE).mean())  # the table's empty cells
    assert interpreter.lockstep_bubble(one_f, [0] + [1] * 7) == pytest.approx(idle, rel=1e-12)
    costs = np.array([0, F, 3 * F, 3 * F, 2 * F, 2 * F, 3 * F, 3 * F])
    step = costs[one_f.action].max(axis=1).sum()
    assert step == (m + stages - 1) * (F + 3 * F) - F
    busy = costs[one_f.action].sum() / (stages * step)
    assert 1 - busy == pytest.approx(interpreter.lockstep_bubble(one_f, costs), rel=1e-12)
    assert interpreter.lockstep_bubble(one_f, costs) <= bubble_fraction(stages, m) + F * m / (
        stages * step)  # the formula, plus the last stage's forwards its backward runs


def test_1f1b_memory_does_not_grow_with_the_microbatches():
    """Against today's GPipe (autodiff keeps M microbatches' residuals of every layer),
    1F1B and interleaved keep about S inputs; at a fixed global batch their memory does not
    grow with M. (Both hold the inputs' gradient, one microbatch's residuals and the
    weights' gradient besides.)"""
    gpipe = temp_bytes("autodiff", 16)
    one_f, one_f_more = temp_bytes("1f1b", 16), temp_bytes("1f1b", 32)
    interleaved, interleaved_more = (temp_bytes("interleaved_1f1b", 16, 2),
                                     temp_bytes("interleaved_1f1b", 32, 2))
    print(f"temp bytes per device: autodiff GPipe {gpipe}, 1f1b {one_f} / {one_f_more} "
          f"(M = 16 / 32), interleaved {interleaved} / {interleaved_more}")
    assert one_f <= 0.5 * gpipe and interleaved <= 0.5 * gpipe
    assert one_f_more <= 1.15 * one_f and interleaved_more <= 1.15 * interleaved
