"""The Hugging Face ``Trainer`` on a run: ``GradientmailCallback``.

::

    from gradientmail import DiLoCo
    from gradientmail.integrations.transformers import GradientmailCallback

    callback = GradientmailCallback(DiLoCo(inner_steps=100, fragments=4), "s3://bucket/run1")
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()

The callback joins the run when training begins (the model then holds the run's newest
parameters, so a node that joins late starts from them), calls ``Session.step`` after every
optimizer step with the tokens of that step's batches (``args.include_num_input_tokens_seen``
on; otherwise the step's samples: batch size times gradient accumulation), and leaves when
training ends, after this node's last rounds committed: the model then holds the run's final
parameters, which the Trainer's own ``save_model`` after ``train()`` writes. Evaluation and
checkpoints during training see this node's working parameters (the last merged commit plus
its own inner steps since), as they would without a run.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from gradientmail.core.algorithm import DiLoCo
from gradientmail.integrations._common import SessionHolder
from gradientmail.mailboxes._protocol import Mailbox

__all__ = ["GradientmailCallback"]


class GradientmailCallback(TrainerCallback):
    """A ``TrainerCallback`` that makes a ``Trainer`` one node of a run.

    Args:
        algorithm: the run's ``DiLoCo``.
        mailbox: a ``Mailbox`` or a URL for ``mailbox_from_url``.
        wait_for_nodes: when above 1, training begins only once this many nodes of the run
            are active (``Session.wait_for_nodes``): for a run launched as that many nodes.
        **session_options: passed to ``Session`` (``learner_id``, ``secret``, ``callbacks``,
            ``poll_interval``, ...).

    Attributes:
        session: the open ``Session`` while training runs, else None.
    """

    def __init__(
        self,
        algorithm: DiLoCo,
        mailbox: Mailbox | str,
        *,
        wait_for_nodes: int = 0,
        **session_options: Any,
    ) -> None:
        self._holder = SessionHolder(
            algorithm, mailbox, session_options, wait_for_nodes=wait_for_nodes
        )
        self._tokens_seen = 0

    @property
    def session(self) -> Any:
        return self._holder.session

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        **kwargs: Any,
    ) -> None:
        if model is None:
            raise ValueError("the Trainer passed no model to on_train_begin")
        self._holder.open(model)
        self._tokens_seen = int(state.num_input_tokens_seen or 0)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        seen = int(state.num_input_tokens_seen or 0)
        if seen > self._tokens_seen:
            samples, self._tokens_seen = seen - self._tokens_seen, seen
        else:
            samples = args.per_device_train_batch_size * args.gradient_accumulation_steps
        self._holder.step(samples)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._holder.close()
