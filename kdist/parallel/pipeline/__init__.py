"""The ``stage`` mesh axis: a scanned layer stack split into pipeline stages.

=================  ===========================================================================
``settings``       a pipeline's settings, their checks and its bubble (no JAX)
``stack``          the stack through the stages: GPipe's scan (``pipelined``) and, for the
                   other schedules, the loss inside the schedule (``scheduled``)
``schedules``      schedule tables (GPipe, 1F1B, interleaved, zero-bubble) as data
``interpreter``    one SPMD program that runs any table, forwards and backwards by tick
``every_stage``    every stage runs each tick's kind of task (collectives among all devices)
``schedule_region`` the interpreter over the mesh: its region, one gradient reduction, the loss
                   as a ``custom_vjp``
``transform``      the step's transforms: the stage axis' checks, and a schedule that runs
                   a task's parts (``ScheduleParts``) with the loss inside it
=================  ===========================================================================

Dependencies point one way: settings <- stack <- schedule_region <- interpreter <-
every_stage (and :mod:`kdist.parallel.reduction`'s gather and reduce, once per step);
transform calls stack
(and is called by :mod:`kdist.parallel.step`).

Example:
    >>> from kdist.parallel import pipeline
    >>> pipeline.stages()  # no distribution: no pipeline
    1
"""

from kdist.parallel.pipeline.settings import Schedule, bubble_fraction, check_settings
from kdist.parallel.pipeline.stack import (
    layout_axes,
    pipelined,
    schedule_for,
    scheduled,
    scheduled_name,
    stack_shape,
    stages,
)

__all__ = ["Schedule", "bubble_fraction", "check_settings", "layout_axes", "pipelined",
           "schedule_for", "scheduled", "scheduled_name", "stack_shape", "stages"]
