"""Everything about devices and sharding, one concern a module.

=================  ===========================================================================
``mesh``           the mesh axes (a registry), mesh specs, device order
``rules``          logical axes of weights -> mesh axes, as data; layers' declarations
``layout``         the Keras distribution: a checked layout for every weight and the batch
``constraints``    activation sharding, gathered weights, the per-device (shard_map) region
``reduction``      explicit gradient reduction (one collective per weight)
``pipeline``       the stage axis: a scanned layer stack's GPipe schedule, circular repeats
``stages``         the pipeline's settings, checks and bubble (no JAX)
``step``           which step features run, asked of the model's declaration
``auto``           sharding by structure and shape for models without declarations
``report``         the coverage report
``devices``        forcing N host (CPU) devices, explicitly
=================  ===========================================================================

Dependencies point one way: mesh, rules, stages <- auto <- layout <- constraints <-
reduction <- step, and constraints <- pipeline (called by ``kdist.models.scan``); report and
devices on the side.
"""

from kdist.parallel.devices import force_host_devices
from kdist.parallel.layout import KdistDistribution, active, distribution
from kdist.parallel.mesh import AXES, MeshAxis, mesh_spec, parse_mesh

__all__ = ["AXES", "KdistDistribution", "MeshAxis", "active", "distribution",
           "force_host_devices", "mesh_spec", "parse_mesh"]
