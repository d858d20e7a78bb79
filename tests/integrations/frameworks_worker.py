"""One node whose loop is a framework's own: ``python frameworks_worker.py FRAMEWORK URL NODE
OUT --steps N --wait-for a,b``. FRAMEWORK is ``transformers`` (a ``Trainer`` on a tiny GPT-2
built from its config) or ``lightning`` (a ``Trainer`` fitting a tiny LightningModule, two
batches a step). Writes its final parameters' digest and losses as JSON to OUT."""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from typing import Any

import torch

from gradientmail import DiLoCo

ALGORITHM = DiLoCo(inner_steps=10, fragments=2, overlap_steps=1, quorum_size=2, grace=10.0)
# keep_rounds=None: nothing is collected, so the audit recomputes every commit.
QUICK = {"poll_interval": 0.05, "lease_every": 0.5, "lease_timeout": 2.0, "keep_rounds": None}


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode() + tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def gpt2(seed: int) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    return GPT2LMHeadModel(config)


def token_data(seed: int, n: int) -> list[dict[str, torch.Tensor]]:
    """Sequences of a learnable pattern (each token is the previous plus a per-sequence step)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 64, (n, 1), generator=g)
    steps = torch.randint(1, 4, (n, 1), generator=g)
    ids = (starts + steps * torch.arange(16)) % 64
    return [{"input_ids": row, "labels": row} for row in ids]


def regression(seed: int) -> Any:
    """A tiny LightningModule: a two-layer regression net trained with SGD."""
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(seed)
    return Regression()


def make_model(framework: str, seed: int) -> Any:
    return gpt2(seed) if framework == "transformers" else regression(seed)


def run_transformers(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    from gradientmail.integrations.transformers import GradientmailCallback

    model = gpt2(seed=args.seed)
    nodes = len(args.wait_for.split(",")) if args.wait_for else 0
    callback = GradientmailCallback(
        ALGORITHM, args.url, learner_id=args.node, wait_for_nodes=nodes, **QUICK
    )
    training = TrainingArguments(
        output_dir=args.out + ".trainer",
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        report_to=[],
        logging_strategy="no",
        save_strategy="no",
        use_cpu=True,
        include_num_input_tokens_seen=True,
        disable_tqdm=True,
        seed=args.seed,
    )
    data = token_data(args.seed, 4 * args.steps)
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[callback])
    held_out = token_data(999, 64)
    before = trainer.evaluate(held_out)["eval_loss"]
    trainer.train()
    assert callback.session is None, "the Session is closed when training ends"
    return {
        "params": digest(model),
        "before": before,
        "after": trainer.evaluate(held_out)["eval_loss"],
    }


def run_lightning(args: argparse.Namespace) -> dict[str, Any]:
    import lightning.pytorch as pl

    from gradientmail.integrations.lightning import GradientmailCallback

    module = regression(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    target = torch.randn(8, 1, generator=torch.Generator().manual_seed(0))
    x = torch.randn(2 * 16 * args.steps, 8, generator=g)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x @ target), batch_size=16
    )
    held_x = torch.randn(256, 8, generator=torch.Generator().manual_seed(999))

    def loss() -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(module.net(held_x), held_x @ target))

    before = loss()
    nodes = len(args.wait_for.split(",")) if args.wait_for else 0
    callback = GradientmailCallback(
        ALGORITHM, args.url, learner_id=args.node, wait_for_nodes=nodes, **QUICK
    )
    trainer = pl.Trainer(
        max_steps=args.steps,
        accumulate_grad_batches=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(module, loader)
    assert callback.session is None, "the Session is closed when fitting ends"
    return {"params": digest(module), "before": before, "after": loss()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=["transformers", "lightning"])
    parser.add_argument("url")
    parser.add_argument("node")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wait-for", default="")
    args = parser.parse_args()
    run = run_transformers if args.framework == "transformers" else run_lightning
    result = run(args)
    result["closed_at"] = time.time()
    with open(args.out, "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main()
