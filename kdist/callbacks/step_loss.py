"""Each step's training loss, recovered from the running epoch mean Keras logs.

Keras' ``logs["loss"]`` at batch ``b`` of an epoch is the mean over the epoch's batches so
far (a sawtooth when plotted: it drops at every epoch start). The step's own loss follows
exactly from two consecutive means: ``(n_k m_k - n_j m_j) / (n_k - n_j)`` for the batches
``j < k`` seen so far, ``n`` counting the epoch's batches (equal batch sizes, as kdist's
datasets give). In an epoch a resumed ``fit`` entered half-way the mean also holds batches
of the run before: kdist's ``Checkpoint`` restores it and says how many
(:meth:`StepLosses.resume`), and the steps follow as in any epoch. Resumed any other way,
that epoch's steps are not recovered: nothing there is better than a wrong figure.

Example:
    >>> losses = StepLosses()
    >>> [losses.observe(0, n, mean) for n, mean in ((1, 4.0), (2, 3.5), (3, 3.0))]
    [4.0, 3.0, 2.0]
"""

from __future__ import annotations


class StepLosses:
    """Feeds on ``(epoch, batches done in the epoch, running mean)``; returns the mean loss
    of the batches since the previous observation (one step's loss, or the mean over a
    multi-step execution), or None where it cannot be known."""

    def __init__(self, resumed_epoch: int | None = None):
        self.resumed_epoch = resumed_epoch  # the epoch this fit entered half-way, if any
        self._epoch, self._behind, self._done, self._total = None, 0, 0, 0.0

    def resume(self, epoch: int, batches: int, total: float) -> None:
        """The running mean of ``epoch`` goes on from ``batches`` batches of an earlier run
        whose losses sum to ``total`` (what kdist's ``Checkpoint`` restores mid-epoch).

        Example:
            >>> losses = StepLosses(resumed_epoch=0)
            >>> losses.resume(0, 2, 7.0)  # the restored mean: 3.5 over 2 batches
            >>> losses.observe(0, 1, 3.0)  # Keras' mean after one more: (7 + 2) / 3
            2.0
        """
        if epoch == self.resumed_epoch:
            self.resumed_epoch = None
        self._epoch, self._behind, self._done, self._total = epoch, batches, batches, total

    def observe(self, epoch: int, done: int, mean: float | None) -> float | None:
        if epoch != self._epoch:
            self._epoch, self._behind, self._done, self._total = epoch, 0, 0, 0.0
        done += self._behind  # batches in the mean: Keras numbers this fit's from 0
        if mean is None or epoch == self.resumed_epoch or done <= self._done:
            return None
        total = done * float(mean)
        loss = (total - self._total) / (done - self._done)
        self._done, self._total = done, total
        return loss


def per_optimizer_step(losses: list[tuple[int, float]], accumulation: int) -> list[list]:
    """``[[optimizer step, loss], ...]`` of ``(fit step, loss)`` pairs (1-based fit steps;
    with gradient accumulation an optimizer step's loss is its micro-batches' mean).

    Example:
        >>> per_optimizer_step([(1, 4.0), (2, 2.0), (3, 1.0)], accumulation=2)
        [[1, 3.0], [2, 1.0]]
    """
    steps: dict[int, list[float]] = {}
    for fit_step, loss in losses:
        steps.setdefault(-(-fit_step // accumulation), []).append(loss)
    return [[step, sum(values) / len(values)] for step, values in steps.items()]
