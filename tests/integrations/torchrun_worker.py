"""One rank of a node made of a ``torchrun`` group (gloo on CPU): a small regression model in
``DistributedDataParallel``, its ``GroupSession`` on the run; writes its final parameters.

    python -m torch.distributed.run --standalone --nproc-per-node 2 torchrun_worker.py \\
        URL NODE OUT --steps 40 --nodes 2 [--die-at STEP]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradientmail import DiLoCo
from gradientmail.integrations.torchrun import GroupSession

ALGORITHM = DiLoCo(inner_steps=8, fragments=2, overlap_steps=1, grace=30.0)
BATCH = 8


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("node")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--die-at", type=int, default=-1, help="rank 1 exits at this step")
    parser.add_argument(
        "--bad-samples-at", type=int, default=-1, help="rank 1 passes samples=-1 at this step"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = make_model()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.02)
    generator = torch.Generator().manual_seed(hash((args.node, rank)) % 2**31)
    target = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    options = {"poll_interval": 0.05, "lease_every": 0.5, "lease_timeout": 3.0}
    with GroupSession(
        model, algorithm=ALGORITHM, mailbox=args.url, learner_id=args.node, **options
    ) as session:
        session.wait_for_nodes(args.nodes, timeout=120)
        for step in range(args.steps):
            if rank == 1 and step == args.die_at:
                os._exit(3)  # a rank dies without a word: its group must leave, not hang
            x = torch.randn(BATCH, 4, generator=generator)
            loss = ((ddp(x) - x @ target) ** 2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            bad = rank == 1 and step == args.bad_samples_at
            session.step(samples=-1 if bad else BATCH)
    result = {
        "node": args.node,
        "rank": rank,
        "params": digest(model),
        "rounds": session.rounds_seen,
    }
    Path(args.out, f"{args.node}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: gloo's threads sometimes abort the process
    # there ("terminate called without an active exception", about one run in eight here),
    # after everything above is done and written.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
