"""A worker of tests/python/test_checkpoint.py: a linear layer, ones as every gradient, ITERS
steps (argv[1]); prints the clock it started at."""
import sys

import torch

import dsyncps
import dsyncps.torch as dps

torch.manual_seed(0)
model = torch.nn.Linear(7, 3)
with torch.no_grad():
    for p in model.parameters():
        p.fill_(0.5)
dps.init()
opt = dps.ServerOptimizer(model, "sum")
print("start clock %d" % dsyncps.worker().job["start_clock"], flush=True)
for _ in range(int(sys.argv[1])):
    opt.zero_grad()
    sum(p.sum() for p in model.parameters()).backward()  # every gradient element is 1
    opt.step()
dps.shutdown()
