#!/usr/bin/python3
"""PyTorch DDP (gloo) baseline for dsyncps's main job: the same MLP (784-256-128-10, ReLU,
softmax cross-entropy) on Fashion-MNIST, the same per-worker batch (64), data shards, momentum
SGD, training budget and straggler model, on N processes of this machine.

Test accuracy is measured like `dsyncps train` does: model snapshots are taken every
--eval-interval seconds (by rank 0, a copy of the weights, without stopping training) and
evaluated on the whole test set afterwards; time is counted from the launch of this script.
Prints one JSON line: {"mode":"ddp", "first_reach_s":..., "stays_from_s":..., ...}.

Needs Debian's python3-torch and libopenblas0 (without OpenBLAS torch silently uses the
reference BLAS, about 15x slower). Run it with /usr/bin/python3.
"""
import argparse
import gzip
import json
import os
import time

LAUNCH = time.monotonic()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def load(data_dir, split):
    def read(name, offset):
        with gzip.open(os.path.join(data_dir, name), "rb") as f:
            return np.frombuffer(f.read(), dtype=np.uint8, offset=offset)
    x = read(f"{split}-images-idx3-ubyte.gz", 16).reshape(-1, 784).astype(np.float32) / 255.0
    y = read(f"{split}-labels-idx1-ubyte.gz", 8).astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


def mlp():
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def weights(model):
    # numpy copies: they travel to the parent by value, not as shared-memory handles that
    # die with this process
    return {k: v.detach().numpy().copy() for k, v in model.module.state_dict().items()}


def worker(rank, args, port, out_queue):
    torch.set_num_threads(1)  # N processes share the machine's cores, as dsyncps's workers do
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.workers)
    torch.manual_seed(args.seed)
    x, y = load(args.data_dir, "train")
    model = DDP(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loss_fn = nn.CrossEntropyLoss()
    shard = torch.arange(rank, x.shape[0], args.workers)
    gen = torch.Generator().manual_seed(args.seed * 1000003 + rank)
    budget = int(np.ceil(args.epochs * x.shape[0] / args.batch))
    iters = budget // args.workers
    slow = args.straggler_factor if rank == args.straggler else 1.0
    snapshots = []
    next_snap = time.monotonic()
    order, cursor = shard[torch.randperm(len(shard), generator=gen)], 0
    for it in range(iters):
        if rank == 0 and time.monotonic() >= next_snap:
            snapshots.append((time.monotonic() - LAUNCH, it, weights(model)))
            next_snap += args.eval_interval
        if cursor + args.batch > len(order):
            order, cursor = shard[torch.randperm(len(shard), generator=gen)], 0
        idx = order[cursor:cursor + args.batch]
        cursor += args.batch
        opt.zero_grad()
        loss = loss_fn(model(x[idx]), y[idx])
        loss.backward()  # DDP all-reduces (averages) the gradients here
        # The straggler model of dsyncps's trainer (apps/dsyncps/train.cc): the added
        # --compute-ms, slow x as long on the slow rank, and nothing else. The gradient's own
        # computation is not stretched on either side: timed here it would include the
        # all-reduce's wait, and slow DDP's straggler by its communication as well.
        extra = args.compute_ms / 1000.0 * slow
        if extra > 0:
            time.sleep(extra)
        opt.step()
    dist.barrier()
    if rank == 0:
        snapshots.append((time.monotonic() - LAUNCH, iters, weights(model)))
        out_queue.put(snapshots)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=float, default=10)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--compute-ms", type=float, default=0)
    p.add_argument("--straggler", type=int, default=-1, help="rank slowed down")
    p.add_argument("--straggler-factor", type=float, default=1.0)
    p.add_argument("--eval-interval", type=float, default=0.5)
    p.add_argument("--target", type=float, default=0.85)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    args = p.parse_args()

    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker, args=(r, args, port, queue)) for r in range(args.workers)]
    for proc in procs:
        proc.start()
    snapshots = queue.get()
    for proc in procs:
        proc.join()
    train_seconds = time.monotonic() - LAUNCH

    torch.set_num_threads(os.cpu_count() or 1)
    tx, ty = load(args.data_dir, "t10k")
    model = mlp()
    curve = []
    with torch.no_grad():
        for seconds, it, state in snapshots:
            model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
            acc = (model(tx).argmax(1) == ty).float().mean().item()
            curve.append((seconds, it, acc))
    first = next((c for c in curve if c[2] >= args.target), None)
    stays = None
    for c in reversed(curve):
        if c[2] < args.target:
            break
        stays = c
    straggler = (f"worker {args.straggler} {args.straggler_factor:g}x slower"
                 if args.straggler >= 0 and args.straggler_factor != 1 else "balanced")
    print(json.dumps({
        "mode": "ddp", "backend": "gloo", "workers": args.workers, "scenario": straggler,
        "seconds": train_seconds, "final_accuracy": curve[-1][2], "target": args.target,
        "first_reach_s": first[0] if first else None, "first_reach_iter": first[1] if first else None,
        "stays_from_s": stays[0] if stays else None,
        "curve": [{"seconds": s, "iteration": i, "accuracy": a} for s, i, a in curve]}))


if __name__ == "__main__":
    main()
