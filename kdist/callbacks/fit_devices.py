"""The devices a ``fit`` runs on, as the callbacks count them.

Example:
    >>> devices, local, process = fit_devices()
    >>> len(local) >= 1 and process == 0
    True
"""

from __future__ import annotations

import keras


def fit_devices() -> tuple[list, list, int]:
    """``(devices, local devices, process index)``: the active distribution's devices (all
    processes'), or the first device without one; this process's among them (at least
    one); and this process's index."""
    import jax

    distribution = keras.distribution.distribution()
    if distribution is not None:
        devices = list(distribution.device_mesh.backend_mesh.devices.flat)
    else:
        devices = [jax.devices()[0]]
    local = [d for d in devices if d.process_index == jax.process_index()]
    return devices, local or jax.local_devices()[:1], jax.process_index()
