#!/usr/bin/python3
"""A plain PyTorch CNN on Fashion-MNIST, trained data-parallel by dsyncps or by DDP.

    dsyncps launch --workers 4 --servers 2 --sync dsync:auto --max-gradients 2812 -- python3 fmnist_cnn.py
    torchrun --nproc_per_node 4 fmnist_cnn.py --ddp
    python3 fmnist_cnn.py --ddp --nproc 4      # the same, where torchrun does not run

(Debian 12's torchrun, from PyTorch 1.13 on Python 3.11, fails before it starts anything,
in torch.distributed.elastic's Std.from_str; --nproc starts the DDP processes the way
torchrun would, with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.)

The lines marked "dsyncps" are all it takes. Launched with `--max-gradients G` (the job's
budget), every worker trains until the job has committed G gradients, so a fast worker does
more than its share while a straggler does less and nobody waits for it: that is where
delayed synchronization saves time (2812 is 3 epochs of 60000 images in batches of 64).
Without a budget each worker does its share, --epochs x 60000 / (--batch x workers)
iterations, and the job ends with the slowest. The optimizer runs on the servers (momentum
SGD here); with --ddp it runs in every process, after DDP's all-reduce (gloo).

Rank 0 keeps a copy of the model every --eval-interval seconds and evaluates the copies on
the 10000 test images after training, so measuring never slows the job; time counts from the
start of this script. With --out DIR it writes metrics.csv and summary.json as
`dsyncps train` does (`dsyncps compare --runs DIR ...` tables and plots them), and the
last line it prints is the summary: @train {...}.

Data: Debian's dataset-fashion-mnist (/usr/share/datasets/fashion-mnist), read with
torchvision's FashionMNIST, which wants the files unpacked: they are, once, into --cache.
"""
import argparse
import gzip
import json
import os
import shutil
import sys
import time

START = time.monotonic()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402

import dsyncps.torch as dps  # dsyncps  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ddp", action="store_true", help="train with DistributedDataParallel (torchrun)")
    p.add_argument("--nproc", type=int, default=0, help="with --ddp: start this many processes here")
    p.add_argument("--epochs", type=float, default=3.0, help="passes over the training set, all workers together")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/dsyncps-fmnist"))
    p.add_argument("--eval-interval", type=float, default=1.0, help="seconds between model copies")
    p.add_argument("--target", type=float, default=0.90)
    p.add_argument("--slow-rank", type=int, default=-1, help="this rank computes --slow-factor times slower")
    p.add_argument("--slow-factor", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--out", default="", help="folder for metrics.csv and summary.json (rank 0)")
    p.add_argument("--label", default="")
    return p.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.fc = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def fashion_mnist(args, train):
    # torchvision reads the unpacked IDX files from <root>/FashionMNIST/raw.
    raw = os.path.join(args.cache, "FashionMNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                 "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        dst = os.path.join(raw, name)
        if not os.path.exists(dst):
            tmp = "%s.%d" % (dst, os.getpid())  # several workers may unpack at once
            with gzip.open(os.path.join(args.data_dir, name + ".gz")) as f, open(tmp, "wb") as o:
                shutil.copyfileobj(f, o)
            os.replace(tmp, dst)
    ds = torchvision.datasets.FashionMNIST(args.cache, train=train, download=False)
    x = ds.data.unsqueeze(1).float().div_(255).sub_(0.2860).div_(0.3530)
    return x, ds.targets


def evaluate(model, x, y):
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(x[i:i + 2000]) for i in range(0, len(x), 2000)])
    model.train()
    return float((logits.argmax(1) == y).float().mean()), float(F.cross_entropy(logits, y))


def main():
    args = parse()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = Net()
    if args.ddp:
        dist.init_process_group("gloo")
        rank, workers = dist.get_rank(), dist.get_world_size()
        model = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    else:
        dps.init()  # dsyncps
        opt = dps.ServerOptimizer(model, "momentum", lr=args.lr, momentum=args.momentum)  # dsyncps
        rank = int(os.environ.get("DSYNC_WORKER_RANK", "0"))
        workers = int(os.environ.get("DSYNC_NUM_WORKERS", "1"))
        budget = int(os.environ.get("DSYNC_MAX_GRADIENTS", "0"))  # the launch's --max-gradients
    x, y = fashion_mnist(args, train=True)
    # Each worker's share of the epochs. With a job budget every worker trains until the job
    # has its gradients (should_stop): a fast worker does more than its share, a slow one less.
    steps = int(args.epochs * len(x) / (args.batch * workers))
    if not args.ddp and budget:
        steps = budget
    # Batches drawn from the whole training set (with replacement, a stream per rank), so a
    # worker that does more than its share does not over-sample part of the data.
    gen = torch.Generator().manual_seed(args.seed * 1000003 + rank)
    snapshots, losses = [], []
    next_copy = 0.0
    step = 0
    for step in range(steps):
        idx = torch.randint(len(x), (args.batch,), generator=gen)
        opt.zero_grad()
        t0 = time.monotonic()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        forward = time.monotonic() - t0
        loss.backward()
        if rank == args.slow_rank and args.slow_factor > 1:
            # Slower by the factor on compute alone (backward ~ 2x forward), measured before any
            # communication, so DDP's straggler and dsyncps's are slowed alike.
            time.sleep((args.slow_factor - 1) * 3 * forward)
        opt.step()
        losses.append(float(loss))
        if rank == 0 and time.monotonic() - START >= next_copy:
            module = model.module if args.ddp else model
            snapshots.append((time.monotonic() - START, step + 1,
                              {k: v.detach().clone() for k, v in module.state_dict().items()},
                              sum(losses[-20:]) / len(losses[-20:])))
            next_copy = time.monotonic() - START + args.eval_interval
        if step % 200 == 0:
            print("rank %d step %d/%d loss %.4f" % (rank, step, steps, float(loss)), flush=True)
        if not args.ddp and opt.should_stop():  # dsyncps
            break
    seconds = time.monotonic() - START
    module = model.module if args.ddp else model
    if rank == 0:
        snapshots.append((seconds, step + 1, {k: v.detach().clone() for k, v in module.state_dict().items()},
                          sum(losses[-20:]) / max(1, len(losses[-20:]))))
    if args.ddp:
        dist.destroy_process_group()
    else:
        dps.shutdown()  # dsyncps
    if rank == 0:
        report(args, snapshots, seconds, workers, step + 1)


def report(args, snapshots, seconds, workers, steps):
    torch.set_num_threads(os.cpu_count() or 1)  # training is over: evaluate on every core
    tx, ty = fashion_mnist(args, train=False)
    net = Net()
    curve = []
    for t, rnd, state, train_loss in snapshots:
        net.load_state_dict(state)
        acc, test_loss = evaluate(net, tx, ty)
        curve.append({"seconds": t, "round": rnd, "gradients": rnd * workers, "accuracy": acc,
                      "test_loss": test_loss, "train_loss": train_loss})
    first = next((p for p in curve if p["accuracy"] >= args.target), None)
    stays = None
    for p in reversed(curve):
        if p["accuracy"] < args.target:
            break
        stays = p
    sync = "ddp" if args.ddp else os.environ.get("DSYNC_SYNC", "bsp")
    summary = {"label": args.label or sync, "sync": sync,
               "scenario": "fmnist_cnn, %d workers%s" % (workers, "" if args.slow_rank < 0 else
                                                          ", rank %d %gx slower" % (args.slow_rank, args.slow_factor)),
               "workers": workers, "servers": int(os.environ.get("DSYNC_NUM_SERVERS", "0")),
               "batch": args.batch, "ok": True, "seconds": seconds, "final_version": steps,
               "gradients": steps * workers, "final_accuracy": curve[-1]["accuracy"],
               "final_loss": curve[-1]["test_loss"], "target": args.target,
               "first_reach_s": first and first["seconds"], "first_reach_round": first and first["round"],
               "stays_from_s": stays and stays["seconds"], "stays_from_round": stays and stays["round"]}
    print("test accuracy %.4f after %.1f s (%d steps per worker)" % (summary["final_accuracy"], seconds, steps))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "metrics.csv"), "w") as f:
            f.write("seconds,round,gradients,accuracy,test_loss,train_loss\n")
            for p in curve:
                f.write("%.3f,%d,%d,%.4f,%.4f,%.4f\n" % (p["seconds"], p["round"], p["gradients"],
                                                         p["accuracy"], p["test_loss"], p["train_loss"]))
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(dict(summary, curve=curve), f, indent=2)
    print("@train " + json.dumps(summary), flush=True)


def spawn(nproc):
    """Starts `nproc` copies of this script as torchrun would; returns the first bad exit."""
    import socket
    import subprocess
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [a for a in sys.argv if not a.startswith("--nproc")]
    if "--nproc" in sys.argv:  # "--nproc N" as two arguments
        i = sys.argv.index("--nproc")
        argv = sys.argv[:i] + sys.argv[i + 2:]
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable] + argv, env=env))
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c != 0), 0)


if __name__ == "__main__":
    if "--ddp" in sys.argv and "RANK" not in os.environ:
        a = parse()
        if a.nproc > 0:
            raise SystemExit(spawn(a.nproc))
    main()
