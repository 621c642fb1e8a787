"""Everything about devices and sharding, one concern a module.

Settings and layouts:

==================  ==========================================================================
``mesh``            the mesh axes (a registry), mesh specs, device order
``config``          ``Parallelism``: the one settings object (axis sizes, a record per feature)
``combinations``    which features combine: one table of rules, as data
``rules``           logical axes of weights -> mesh axes, as data; layers' declarations
``auto``            sharding by structure and shape for models without declarations
``layout``          the Keras distribution: a checked layout for every weight and the batch
``constraints``     activation sharding, gathered weights
``region``          the per-device (``shard_map``) regions, nested
``coverage``        the coverage report (every weight, its layout, how it got it)
``devices``         forcing N host (CPU) devices, explicitly
``group_jobs``      replica groups as separate jobs: what a group reads from its environment
``online_softmax``  the online-softmax recurrences chunked and context-parallel attention share
==================  ==========================================================================

The training step, a loop over transforms (outermost first):

==================  ==========================================================================
``step``            the step: ``check_compile``, ``prepare`` and ``compute_loss_and_updates``
                    as loops over its ordered ``TRANSFORMS``
``transform``       what a transform is (``Transform``, ``Step``), the step features tasks
                    declare, the step-owner interface (DiLoCo's replica groups,
                    :mod:`kdist.groups.diloco`, are reached through it only)
``context``         the ``seq`` axis: split sequences, ring and all-gather attention
``reduction``       explicit gradient reduction (one collective per weight), with
                    ``compression`` (8-bit codes) and ``dropout`` (each device's mask rows)
``pipeline``        the ``stage`` axis: GPipe, and the schedules run by an interpreter
``experts``         the ``expert`` axis: MoE layers' capacity buffers, the all-to-all that
                    moves them between the experts' devices
``train_step``      Keras' train step with error-feedback residuals carried
==================  ==========================================================================

Dependencies point one way: mesh, rules <- config <- auto <- layout <- constraints, region
<- context, reduction, pipeline <- step (called by ``kdist.models.base.Task``); nothing
here imports :mod:`kdist.groups`, which builds DiLoCo on this package.
"""

from kdist.parallel.devices import force_host_devices
from kdist.parallel.layout import KdistDistribution, active, distribution
from kdist.parallel.mesh import AXES, MeshAxis, mesh_spec, parse_mesh

__all__ = ["AXES", "KdistDistribution", "MeshAxis", "active", "distribution",
           "force_host_devices", "mesh_spec", "parse_mesh"]
