"""A worker on the framework-neutral core (NumPy): pushes known gradients, checks the model.

--mode replay: the gradient of iteration k, tensor t, element i is a formula (exact in
float32) that the C++ replay worker computes alike; the final model is saved to OUT.
--mode bad: every kind of bad input is tried first; each must raise the right exception,
and the worker then trains normally (the job is unharmed).
"""
import argparse
import sys

import numpy as np

import dsyncps

p = argparse.ArgumentParser()
p.add_argument("--mode", default="replay")
p.add_argument("--iters", type=int, default=10)
p.add_argument("--sizes", default="5,300")
p.add_argument("--out", default="")
a = p.parse_args()

rank = dsyncps.rank()
sizes = [int(s) for s in a.sizes.split(",")]


def init_values(t, n):
    i = np.arange(n, dtype=np.int64)
    return (((i * 7 + t) % 23) - 11).astype(np.float32) / np.float32(16)


def gradient(k, t, n):
    i = np.arange(n, dtype=np.int64)
    return (((k * 31 + i * 17 + t * 13 + rank * 7) % 101) - 50).astype(np.float32) / np.float32(64)


def expect_raises(kind, words, fn):
    try:
        fn()
    except kind as e:
        for w in words:
            assert w in str(e), "%r lacks %r" % (str(e), w)
        print("refused as expected: %s: %s" % (kind.__name__, e), flush=True)
        return
    raise AssertionError("no %s for %s" % (kind.__name__, words))


w = dsyncps.init()
ids = [w.register("t%d" % t, init_values(t, n)) for t, n in enumerate(sizes)]
models = [np.zeros(n, dtype=np.float32) for n in sizes]

if a.mode == "bad":
    n = sizes[0]
    expect_raises(TypeError, ["t0", "float64", "float32"],
                  lambda: w.push(ids[0], np.ones(n, dtype=np.float64)))
    expect_raises(TypeError, ["int", "float32"],
                  lambda: w.register("ints", np.ones(4, dtype=np.int32)))
    expect_raises(ValueError, ["not contiguous", "ascontiguousarray"],
                  lambda: w.push(ids[0], np.ones(2 * n, dtype=np.float32)[::2]))
    expect_raises(ValueError, ["t0", "(%d,)" % (n + 1), "(%d,)" % n],
                  lambda: w.push(ids[0], np.ones(n + 1, dtype=np.float32)))
    ro = np.zeros(n, dtype=np.float32)
    ro.setflags(write=False)
    expect_raises(ValueError, ["read-only"], lambda: w.pull(ids[0], ro))
    expect_raises(TypeError, ["no array"], lambda: w.push(ids[0], "not an array"))
    expect_raises(ValueError, ["not registered"], lambda: w.push(99, np.ones(n, dtype=np.float32)))
    expect_raises(ValueError, ["t0", "registered that name already"],
                  lambda: w.register("t0", np.ones(n + 3, dtype=np.float32)))

for m, tid in zip(models, ids):
    w.pull(tid, m).wait()
version = 0
for k in range(a.iters):
    reqs = [w.push_pull(tid, gradient(k, t, n), models[t])
            for t, (tid, n) in enumerate(zip(ids, sizes))]
    version = min(r.wait() for r in reqs)
print("rank %d done: %d iterations, version %d" % (rank, a.iters, version), flush=True)
print("rank %d job: %s, staleness policy %s, optimizer %s" %
      (rank, w.job["sync"], w.job["staleness"], w.job["optimizer"]["kind"]), flush=True)
if a.out:
    np.concatenate(models).tofile("%s.%d" % (a.out, rank))
dsyncps.shutdown()
