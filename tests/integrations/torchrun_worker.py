"""One rank of a node made of a ``torchrun`` group (gloo on CPU): a small regression model in
``DistributedDataParallel`` or sharded by FSDP2's ``fully_shard`` (``--fsdp``), its
``GroupSession`` on the run; writes its final parameters (with ``--fsdp``, its shards).

    python -m torch.distributed.run --standalone --nproc-per-node 2 torchrun_worker.py \\
        URL NODE OUT --steps 40 --nodes 2 [--die-at STEP] [--fsdp]
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


def local_shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of each parameter of a ``fully_shard`` model (copies)."""
    return {name: p.to_local().detach().clone() for name, p in model.named_parameters()}


def shard_digest(shards: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, t in sorted(shards.items()):
        h.update(f"{name}{tuple(t.shape)}".encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def digest_full(model: torch.nn.Module) -> str:
    """The whole model's digest, each parameter gathered (a test's check, not the library's)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.full_tensor().detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("node")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--die-at", type=int, default=-1, help="rank 1 exits at this step")
    parser.add_argument("--fsdp", action="store_true", help="shard the model with fully_shard")
    parser.add_argument(
        "--bad-samples-at", type=int, default=-1, help="rank 1 passes samples=-1 at this step"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = make_model()
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        ddp = fully_shard(model)
    else:
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
        "params": shard_digest(local_shards(model)) if args.fsdp else digest(model),
        "rounds": session.rounds_seen,
    }
    if args.fsdp:
        torch.save(local_shards(model), Path(args.out, f"{args.node}-rank{rank}.pt"))
        result["full"] = digest_full(model)
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
