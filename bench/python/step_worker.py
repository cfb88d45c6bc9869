"""The Python sides of bench/python/overhead.py: the same iterations as step_worker.cc through
the core (--mode core: push_pull per tensor, then wait) or through dsyncps.torch (--mode
torch: backward hooks and step(); the backward pass alone is timed too, so the layer's own
cost can be told from autograd's), or the same backward pass followed by the core's push_pull
of each gradient in backward order, no hooks (--mode torch-core). Prints one JSON line like step_worker.cc, wall and CPU time
(the process's, every thread) per step."""
import argparse
import json
import resource
import statistics
import time

import numpy as np

import dsyncps

p = argparse.ArgumentParser()
p.add_argument("--mode", default="core")
p.add_argument("--steps", type=int, default=60)
p.add_argument("--sizes", default="600000,300000,99000,1000")
a = p.parse_args()
sizes = [int(s) for s in a.sizes.split(",")]


def faults():
    """Minor page faults of the process so far (first touches; slow on these VMs)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def median_after_warmup(ms):
    warm = min(len(ms) // 5, 10)
    return statistics.median(ms[warm:]), len(ms) - warm


if a.mode == "core":
    w = dsyncps.init()
    model = [np.full(n, 0.5, np.float32) for n in sizes]
    grad = [np.full(n, 1e-3, np.float32) for n in sizes]
    ids = [w.register("t%d" % i, m) for i, m in enumerate(model)]
    ms, cpu = [], []
    f0 = faults()
    for k in range(a.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        reqs = [w.push_pull(t, g, m) for t, g, m in zip(ids, grad, model)]
        for r in reqs:
            r.wait()
        ms.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    med, n = median_after_warmup(ms)
    print(json.dumps({"mode": "core", "ms_per_step": med, "steps": n,
                      "cpu_ms_per_step": median_after_warmup(cpu)[0],
                      "faults_per_step": (faults() - f0) / a.steps}), flush=True)
else:
    import torch

    import dsyncps.torch as dps
    torch.set_num_threads(1)
    params = [torch.nn.Parameter(torch.full((n,), 0.5)) for n in sizes]
    coeff = [torch.full((n,), 1e-3) for n in sizes]

    def backward():  # the same graph as torch_step_worker.cc's (sum() would add 0 + first)
        loss = (params[0] * coeff[0]).sum()
        for p_, c in zip(params[1:], coeff[1:]):
            loss = loss + (p_ * c).sum()
        loss.backward()

    def zero_grads():  # what zero_grad does (torch 1.13: zeroed in place, not dropped)
        for p_ in params:
            if p_.grad is not None:
                p_.grad.zero_()

    # Joined first: init() pins glibc's heap thresholds (docs/python.md), which the backward
    # pass timed alone should run with too.
    dps.init()
    # zero_grad and autograd alone, the same passes: what any training loop pays without dsyncps
    plain, plain_cpu = [], []
    f0 = faults()
    for k in range(a.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        zero_grads()
        backward()
        plain.append((time.perf_counter() - t0) * 1e3)
        plain_cpu.append((time.process_time() - c0) * 1e3)
    plain_faults = (faults() - f0) / a.steps
    if a.mode == "torch":
        opt = dps.ServerOptimizer([("t%d" % i, p_) for i, p_ in enumerate(params)], "sgd",
                                  lr=0.01)
    else:  # torch-core: the same backward pass, then the core's push_pull in backward order
        w = dsyncps.worker()
        ids = [w.register("t%d" % i, p_.detach()) for i, p_ in enumerate(params)]
    ms, cpu = [], []
    f0 = faults()
    for k in range(a.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        if a.mode == "torch":
            opt.zero_grad()
            backward()
            opt.step()
        else:
            zero_grads()
            backward()
            reqs = [w.push_pull(ids[i], params[i].grad, params[i].data)
                    for i in reversed(range(len(params)))]
            for r in reqs:
                r.wait()
        ms.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    med, n = median_after_warmup(ms)
    print(json.dumps({"mode": a.mode, "ms_per_step": med, "steps": n,
                      "cpu_ms_per_step": median_after_warmup(cpu)[0],
                      "backward_ms": median_after_warmup(plain)[0],
                      "backward_cpu_ms": median_after_warmup(plain_cpu)[0],
                      "faults_per_step": (faults() - f0) / a.steps,
                      "backward_faults_per_step": plain_faults}), flush=True)
dsyncps.shutdown()
