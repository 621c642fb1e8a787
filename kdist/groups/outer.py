"""DiLoCo's outer step: the one update of the shared weights from the groups' averaged
parameter change — in one program (:mod:`kdist.groups.diloco`) and between separate
group jobs (:mod:`kdist.groups.sync`) alike.

Example:
    >>> outer_update((0.7, 0.9, True), 1.0, 0.0, 0.5)
    (0.3350000000000001, 0.5)
"""

from __future__ import annotations


def outer_settings(optimizer) -> tuple[float, float, bool]:
    """``(learning rate, momentum, nesterov)`` of a :class:`DiLoCo`'s outer SGD."""
    return (optimizer.outer_learning_rate, optimizer.outer_momentum, optimizer.outer_nesterov)


def outer_update(settings, theta, momentum, delta):
    """SGD with (Nesterov) momentum on the outer gradient, as the paper's PyTorch SGD:
    ``m = mu m + delta; theta -= lr (delta + mu m)`` (``lr m`` without Nesterov).
    ``settings``: :func:`outer_settings`. The one outer step of both the in-program sync
    and separate group jobs (:mod:`kdist.groups.sync`)."""
    lr, mu, nesterov = settings
    momentum = mu * momentum + delta
    step = delta + mu * momentum if nesterov else momentum
    return theta - lr * step, momentum
