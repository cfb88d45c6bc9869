"""Workers on dsyncps.torch for the tests of test_torch.py (one --mode each)."""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

import torch

import dsyncps.torch as dps

p = argparse.ArgumentParser()
p.add_argument("--mode", default="train")
p.add_argument("--iters", type=int, default=40)
p.add_argument("--out", default="")
p.add_argument("--joiner", action="store_true")
p.add_argument("--config", default="{}")
a = p.parse_args()
rank = dps.rank()
torch.manual_seed(1234)  # every worker builds the same initial model


def report(**kw):
    print("REPORT " + json.dumps(kw), flush=True)


def data(seed, n=256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    y = ((x[:, 0] + 0.5 * x[:, 1]) > 0).long()
    return x, y


if a.mode == "train":
    # A small MLP on a separable problem, each worker its own data.
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    dps.init()
    opt = dps.ServerOptimizer(model, "momentum", lr=0.1, momentum=0.9)
    x, y = data(100 + rank)
    first = None
    for i in range(a.iters):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        first = float(loss) if first is None else first
        if rank == 2:
            time.sleep(0.01)  # a slower worker, so the bound matters
    with torch.no_grad():
        acc = float((model(x).argmax(1) == y).float().mean())
    report(rank=rank, first=first, last=float(loss), acc=acc)
    dps.shutdown()

elif a.mode == "hooks":
    # Pushes start inside backward(); a parameter without a gradient still lets steps commit.
    layers = [torch.nn.Linear(64, 64) for _ in range(6)]
    unused = torch.nn.Linear(3, 3)
    model = torch.nn.ModuleDict({"body": torch.nn.Sequential(*layers), "unused": unused})
    dps.init()
    opt = dps.ServerOptimizer(model, "sgd", lr=0.01)
    pushes = []

    class Timed:
        """The worker, with the time of each push_pull recorded."""

        def __init__(self, w):
            self.w = w

        def push_pull(self, *args):
            pushes.append(time.perf_counter())
            return self.w.push_pull(*args)

        def __getattr__(self, name):
            return getattr(self.w, name)

    opt._worker = Timed(opt._worker)
    before = unused.weight.detach().clone()
    versions = []
    lags = []
    x = torch.randn(32, 64)
    for i in range(5):
        pushes.clear()
        opt.zero_grad()
        loss = model["body"](x).pow(2).mean()
        loss.backward()
        ended = time.perf_counter()
        lags.append(ended - min(pushes))
        assert len(pushes) == 12, len(pushes)  # 6 weights + 6 biases, none for 'unused'
        opt.step()
        versions.append(opt.version)
    report(rank=rank, lags=lags, versions=versions,
           unused_same=bool(torch.equal(before, unused.weight.detach())))
    dps.shutdown()

elif a.mode == "bad":
    def refused(kind, words, fn):
        try:
            fn()
        except kind as e:
            missing = [w for w in words if w not in str(e)]
            assert not missing, (str(e), missing)
            print("refused as expected: %s: %s" % (kind.__name__, e), flush=True)
            return
        raise AssertionError("no %s (%s)" % (kind.__name__, words))

    model = torch.nn.Linear(4, 3)
    early = dps.ServerOptimizer(model, "sgd", lr=0.1)
    refused(RuntimeError, ["dsyncps.init()"], early.step)
    del early
    refused(TypeError, ["weight", "torch.float64", "float32"],
            lambda: dps.ServerOptimizer(torch.nn.Linear(2, 2).double(), "sgd", lr=0.1))
    refused(ValueError, ["nesterov"],
            lambda: dps.ServerOptimizer(model, "sgd", lr=0.1, nesterov=True))
    refused(ValueError, ["not one of"], lambda: dps.ServerOptimizer(model, "lbfgs", lr=0.1))
    dps.init()
    # a transposed (non-contiguous) parameter trains like any other
    model.weight = torch.nn.Parameter(torch.randn(3, 4).t().contiguous().t())
    assert not model.weight.is_contiguous()
    opt = dps.ServerOptimizer(model, "sgd", lr=0.1)
    refused(RuntimeError, ["already has a dsyncps ServerOptimizer"],
            lambda: dps.ServerOptimizer(model, "sgd", lr=0.1))
    w0 = model.weight.detach().clone()
    x = torch.ones(8, 4)
    for i in range(a.iters):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    # grad of the sum is 8 for every weight: each of the 2 workers' mean is 8 per round
    expect = w0 - a.iters * 0.1 * 8
    report(rank=rank, ok=bool(torch.allclose(model.weight.detach(), expect, atol=1e-4)))
    dps.shutdown()

elif a.mode == "shape":
    # Worker 1 builds another shape for one layer: its registration must be refused,
    # naming the parameter and both shapes; worker 0 trains on.
    model = torch.nn.Sequential(torch.nn.Linear(6, 8 if rank == 0 else 5), torch.nn.Tanh())
    dps.init()
    if rank == 1:
        # Register after worker 0 (which writes the file once it has), so the refusal is ours.
        deadline = time.time() + 60
        while not os.path.exists("registered") and time.time() < deadline:
            time.sleep(0.05)
        try:
            dps.ServerOptimizer(model, "sgd", lr=0.1)
        except Exception as e:
            report(rank=rank, error=str(e), kind=type(e).__name__)
            dps.shutdown()
            sys.exit(0)
        report(rank=rank, error="")
        sys.exit(1)
    opt = dps.ServerOptimizer(model, "sgd", lr=0.1)
    open("registered", "w").close()
    for i in range(a.iters):
        opt.zero_grad()
        model(torch.ones(2, 6)).sum().backward()
        opt.step()
    report(rank=rank, version=opt.version)
    dps.shutdown()

elif a.mode == "exact":
    # sum optimizer, gradients of ones: the model counts the gradients applied. Rank 1 is
    # interrupted (Ctrl-C) at step 6, rank 2 SIGKILLed at step 9, and rank 0 starts a joiner
    # at step 4 that runs 8 steps.
    p = torch.nn.Parameter(torch.zeros(1000))
    dps.init()
    opt = dps.ServerOptimizer([("count", p)], "sum")
    if a.joiner:
        open("joined", "w").close()
    joiner = None
    steps = 8 if a.joiner else a.iters
    done = 0
    try:
        # Rank 0 trains on until the joiner is in: a job whose workers are all gone ends.
        while done < steps or (joiner is not None and not os.path.exists("joined")):
            i = done
            if rank == 0 and not a.joiner and i == 4:
                env = {k: v for k, v in os.environ.items()
                       if k not in ("DSYNC_WORKER_RANK", "DSYNC_READY_FD")}
                joiner = subprocess.Popen([sys.executable, __file__, "--mode", "exact",
                                           "--joiner"], env=env)
            if not a.joiner and rank == 1 and i == 6:
                os.kill(os.getpid(), signal.SIGINT)
            if not a.joiner and rank == 2 and i == 9:
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            p.sum().backward()  # gradient 1: the sum optimizer adds one per gradient
            opt.step()
            done += 1
            time.sleep(0.02)
    except KeyboardInterrupt:
        report(rank=rank, interrupted=True, clock=dps.worker().clock)
        raise
    report(rank=rank, joiner=a.joiner, steps=done)
    dps.shutdown()  # before waiting: under bsp the joiner's rounds need this worker or its leave
    if joiner is not None:
        assert joiner.wait(timeout=60) == 0

elif a.mode == "agree":
    # The same gradients into dsyncps (servers run the optimizer) and into torch.optim here,
    # both driven by the same lr scheduler: the parameters must agree after every step.
    cfg = json.loads(a.config)
    kind = cfg.pop("optimizer")
    torch.manual_seed(7)
    shapes = [(7, 5), (13,), (3, 4, 2)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    dps.init()
    opt = dps.ServerOptimizer([("p%d" % i, p) for i, p in enumerate(params)], kind, **cfg)
    if kind in ("sgd", "momentum"):
        torch_opt = torch.optim.SGD(ref, **cfg)
    else:
        torch_opt = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind](ref, **cfg)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5) for o in (opt, torch_opt)]
    g = torch.Generator().manual_seed(11)
    worst = worst_elem = 0.0
    for k in range(a.iters):
        scale = 10.0 ** ((k % 5) - 2)  # gradients from 0.01 to 100
        grads = [torch.randn(s, generator=g) * scale for s in shapes]
        opt.zero_grad()
        sum((p * G).sum() for p, G in zip(params, grads)).backward()
        opt.step()
        torch_opt.zero_grad()
        for r, G in zip(ref, grads):
            r.grad = G.clone()
        torch_opt.step()
        for s_ in scheds:
            s_.step()
        for p_, r in zip(params, ref):
            # relative to the tensor's magnitude (an element near zero has no scale of its own)
            rel = float((p_.detach() - r.detach()).abs().max() / r.detach().abs().max())
            worst = max(worst, rel)
            elem = float(((p_.detach() - r.detach()).abs() / r.detach().abs().clamp_min(1e-3)).max())
            worst_elem = max(worst_elem, elem)
    report(rank=rank, worst=worst, worst_elem=worst_elem, lr=opt.param_groups[0]["lr"], version=opt.version)
    dps.shutdown()

elif a.mode == "save":
    # Train until the job's budget says stop; then save through an observer: a regular state
    # dict, buffers included, equal to the model every worker holds (bsp).
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 2))
    dps.init()
    opt = dps.ServerOptimizer(model, "adam", lr=0.01)
    x, y = data(200 + rank)
    steps = 0
    while not opt.should_stop() and steps < 1000:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        steps += 1
    sd = dps.state_dict(model)
    path = "model.%d.pt" % rank
    torch.save(sd, path)
    back = torch.load(path)
    same = all(torch.equal(back[k], v.detach()) for k, v in model.state_dict().items())
    report(rank=rank, steps=steps, same=same, keys=sorted(back),
           version=opt.version)
    dps.shutdown()

elif a.mode == "heap":
    # What init() did with glibc's heap thresholds, and the minor page faults of each training
    # step. Eight 512 KiB parameters: each step's temporaries (4 MiB) can exceed what glibc's
    # adaptive trim threshold keeps (twice the largest block it has unmapped), and with its
    # defaults most runs hand the heap's top back and fault it in again step after step.
    import resource
    torch.set_num_threads(1)
    params = [torch.nn.Parameter(torch.full((131072,), 0.5)) for _ in range(8)]
    coeff = [torch.full((131072,), 1e-3) for _ in range(8)]
    dps.init()
    opt = dps.ServerOptimizer([("t%d" % i, p_) for i, p_ in enumerate(params)], "sgd", lr=0.01)
    faults = []
    for i in range(50):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        opt.zero_grad()
        sum((p_ * c).sum() for p_, c in zip(params, coeff)).backward()
        opt.step()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    report(rank=rank, state=dps.heap_state(), faults=faults[10:], version=opt.version)
    dps.shutdown()
