"""The framework-neutral core (dsyncps._core) through real jobs of separate processes."""
import ctypes
import os

import numpy as np
import pytest

np_sizes = "5,300"


def replay_sizes():
    return [int(s) for s in np_sizes.split(",")]


def test_python_core_equals_the_cpp_worker_bit_for_bit(launch, tmp_path):
    # bsp, momentum with weight decay, two servers (slices spread over both), two workers:
    # the same gradients through either front end give the same model, byte for byte.
    # A staleness policy changes nothing under bsp (no gradient is stale); the job says it.
    flags = ["--optimizer", "momentum", "--lr", "0.05", "--momentum", "0.9",
             "--weight-decay", "0.01", "--slice-bytes", "512", "--staleness-policy", "exp:0.5"]
    job = launch(["core_worker.py", "--iters", "12", "--sizes", np_sizes, "--out", tmp_path / "py"],
                 workers=2, servers=2, flags=flags)
    said = [l for l in job.worker_lines() if " job: " in l]
    assert len(said) == 2, job.out[-4000:]
    for line in said:
        assert line.endswith("job: bsp, staleness policy exp:0.5, optimizer momentum"), line
    launch(["exe", os.environ["DSYNCPS_REPLAY_WORKER"], "12", np_sizes, tmp_path / "cc"],
           workers=2, servers=2, flags=flags)
    for rank in (0, 1):
        py = np.fromfile(tmp_path / ("py.%d" % rank), dtype=np.float32)
        cc = np.fromfile(tmp_path / ("cc.%d" % rank), dtype=np.float32)
        assert py.size == sum(replay_sizes())
        assert py.tobytes() == cc.tobytes(), np.flatnonzero(py != cc)[:10]
    # and the model moved: it is not the initial values
    assert not np.all(py[:5] == np.array([-11, -4, 3, -9, -2], dtype=np.float32) / 16)


def test_bad_input_raises_clear_errors_and_the_job_goes_on(launch, tmp_path):
    # Worker 0 tries every kind of bad input first; both then train with the sum optimizer,
    # and the model counts every gradient: nothing bad reached the servers.
    job = launch(["core_worker.py", "--mode", "bad", "--iters", "6", "--sizes", "5,40",
                  "--out", tmp_path / "m"], workers=2, servers=1, flags=["--optimizer", "sum"])
    refused = [l for l in job.worker_lines() if "refused as expected" in l]
    assert len(refused) == 2 * 8, job.out[-4000:]
    m = np.fromfile(tmp_path / "m.0", dtype=np.float32)
    # sum: init + the sum of both workers' gradients of all 6 iterations
    i = np.arange(5)
    expect = (((i * 7) % 23) - 11).astype(np.float32) / 16
    for k in range(6):
        for rank in (0, 1):
            expect = expect + ((((k * 31 + i * 17 + rank * 7) % 101) - 50).astype(np.float32) / 64)
    assert np.allclose(m[:5], expect, rtol=0, atol=1e-6), (m[:5], expect)
    assert len(job.rounds()) == 6


def test_a_cuda_array_is_refused_by_the_core_with_what_to_do():
    from dsyncps import _core

    class FakeCuda:
        """An object whose DLPack export says kDLCUDA, as a GPU tensor's would."""

        def __dlpack__(self, stream=None):
            return make_capsule(device_type=2)

    class FakeCpu:
        def __dlpack__(self, stream=None):
            return make_capsule(device_type=1)

    assert _core._check_array(FakeCpu(), "tensor 'w'") == (1,)
    with pytest.raises(TypeError, match="tensor 'w' is in CUDA memory.*tensor.cpu"):
        _core._check_array(FakeCuda(), "tensor 'w'")


def make_capsule(device_type):
    """A DLPack capsule of one float32 element on `device_type`, built with ctypes."""
    class DLDevice(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]

    class DLDataType(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]

    class DLTensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int),
                    ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                    ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]

    class DLManagedTensor(ctypes.Structure):
        _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                    ("deleter", ctypes.c_void_p)]

    shape = (ctypes.c_int64 * 1)(1)
    value = (ctypes.c_float * 1)(0.0)
    m = DLManagedTensor()
    m.dl_tensor = DLTensor(ctypes.cast(value, ctypes.c_void_p), DLDevice(device_type, 0), 1,
                           DLDataType(2, 32, 1), shape, None, 0)
    m.deleter = None
    make_capsule.keep = (shape, value, m)  # alive for the test's duration
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.addressof(m), b"dltensor", None)


def test_an_rdma_tunable_in_the_settings_is_refused_not_ignored():
    # Read from the environment by each node's transport: passed here it would hold on no node.
    from dsyncps import _core
    with pytest.raises(ValueError, match="DSYNC_RDMA_SLOTS is not a setting dsyncps.init"
                       r"\(\) takes: the RDMA transport's DSYNC_RDMA_\* tunables are read from "
                       "each process's environment"):
        _core.Worker.start({"DSYNC_RDMA_SLOTS": "64"})


def test_a_misspelt_setting_is_named_in_a_warning_not_ignored(monkeypatch):
    # The environment's check runs before anything connects: a role no Python process can
    # take stops the start right after it.
    import warnings
    from dsyncps import _core
    with pytest.warns(RuntimeWarning, match="DSYNC_STALENES_POLICY is not a setting and is "
                      "ignored: did you mean DSYNC_STALENESS_POLICY"):
        with pytest.raises(ValueError, match="Python processes are workers"):
            _core.Worker.start({"DSYNC_ROLE": "server", "DSYNC_STALENES_POLICY": "inverse"})
    # Under a launcher (DSYNC_ENV_CHECKED) the inherited environment was said by it; the
    # settings passed here still are checked.
    monkeypatch.setenv("DSYNC_ENV_CHECKED", "1")
    monkeypatch.setenv("DSYNC_LRR", "0.1")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="Python processes are workers"):
            _core.Worker.start({"DSYNC_ROLE": "server", "DSYNC_MOMENTUMM": "0.5"})
    texts = [str(w.message) for w in said]
    assert texts == ["DSYNC_MOMENTUMM is not a setting and is ignored: did you mean "
                     "DSYNC_MOMENTUM?"], texts
