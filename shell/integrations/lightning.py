"""PyTorch Lightning on a run: ``GradientmailCallback``.

::

    from gradientmail import DiLoCo
    from gradientmail.integrations.lightning import GradientmailCallback

    callback = GradientmailCallback(DiLoCo(inner_steps=100, fragments=4), "/shared/run1")
    lightning.Trainer(max_steps=10_000, callbacks=[callback]).fit(module, loader)

The callback joins the run when fitting starts (the module then holds the run's newest
parameters), calls ``Session.step`` after every optimizer step (a batch after which
``trainer.global_step`` moved, so gradient accumulation is respected) with the samples of the
batches since the last step, and leaves when fitting ends, after this node's last rounds
committed: the module then holds the run's final parameters, which ``trainer.save_checkpoint``
after ``fit`` writes. Validation and checkpoints during fitting see this node's working
parameters, as they would without a run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from gradientmail.core.algorithm import DiLoCo
from gradientmail.integrations._common import SessionHolder
from gradientmail.mailboxes._protocol import Mailbox

__all__ = ["GradientmailCallback", "batch_samples"]


def batch_samples(batch: Any) -> int:
    """The samples in ``batch``: the length of its first dimension (a tensor's, or the first
    tensor's of a tuple, list or dict)."""
    if isinstance(batch, dict):
        batch = next(iter(batch.values()), None)
    elif isinstance(batch, (tuple, list)):
        batch = batch[0] if batch else None
    shape = getattr(batch, "shape", None)
    if shape is None or len(shape) == 0:
        raise TypeError(
            f"cannot count the samples of a batch of {type(batch).__name__}; pass "
            "GradientmailCallback(samples=...) a function of the batch"
        )
    return int(shape[0])


class GradientmailCallback(pl.Callback):
    """A Lightning ``Callback`` that makes a ``Trainer`` one node of a run.

    Args:
        algorithm: the run's ``DiLoCo``.
        mailbox: a ``Mailbox`` or a URL for ``mailbox_from_url``.
        samples: the weight of one batch (samples or tokens); the batch's first dimension by
            default (``batch_samples``).
        wait_for_nodes: when above 1, training begins only once this many nodes of the run
            are active (``Session.wait_for_nodes``): for a run launched as that many nodes.
        **session_options: passed to ``Session``.
    """

    def __init__(
        self,
        algorithm: DiLoCo,
        mailbox: Mailbox | str,
        *,
        samples: Callable[[Any], int] = batch_samples,
        wait_for_nodes: int = 0,
        **session_options: Any,
    ) -> None:
        self._holder = SessionHolder(
            algorithm, mailbox, session_options, wait_for_nodes=wait_for_nodes
        )
        self._samples = samples
        self._pending = 0
        self._global_step = 0

    @property
    def session(self) -> Any:
        return self._holder.session

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._holder.open(pl_module)
        self._pending, self._global_step = 0, trainer.global_step

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._pending += self._samples(batch)
        if trainer.global_step > self._global_step:  # the optimizer stepped on this batch
            self._global_step = trainer.global_step
            self._holder.step(self._pending)
            self._pending = 0

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._holder.close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._holder.close()
