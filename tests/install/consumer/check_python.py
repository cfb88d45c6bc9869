"""The installed Python package, as a worker of a job the installed launcher started: it must
be imported from the prefix (not the build tree), and train exactly: one worker, sgd at lr
0.5, four gradients of ones, so the model ends at its initial value minus 2 in every element.
"""
import sys

import numpy as np

import dsyncps

prefix = sys.argv[1]
assert dsyncps.__file__.startswith(prefix), "imported %s, not from %s" % (dsyncps.__file__, prefix)
w = dsyncps.init()
init = np.arange(10, dtype=np.float32)
tid = w.register("x", init)
model = np.zeros(10, dtype=np.float32)
for _ in range(4):
    w.push_pull(tid, np.ones(10, dtype=np.float32), model).wait()
assert np.array_equal(model, init - 2), model
print("installed python package ok: %s" % dsyncps.__file__, flush=True)
dsyncps.shutdown()
