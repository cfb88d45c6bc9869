"""dsyncps for PyTorch: the servers run the optimizer, the workers push gradients.

    import dsyncps.torch as dps
    dps.init()
    opt = dps.ServerOptimizer(model, "momentum", lr=0.1, momentum=0.9)
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        if opt.should_stop(): break
    dps.shutdown()

Gradients are pushed from backward hooks as each becomes ready, so communication overlaps the
rest of the backward pass; ``step()`` commits the iteration and waits for the next model only
as long as the job's delay bound requires, then leaves it in the module's parameters.
"""
import math
import weakref

import torch

from . import (Error, heap_state, init, initialized, observe, rank, shutdown, stop_requested,
               worker)

__all__ = ["ServerOptimizer", "Observer", "state_dict", "init", "shutdown", "rank",
           "stop_requested", "heap_state", "Error"]

# torch.optim's names and hyperparameters -> the server's optimizer.
_KINDS = ("sgd", "momentum", "adam", "adamw", "sum")
_active = None  # the process's ServerOptimizer (weak reference)


def _named_parameters(model):
    if isinstance(model, torch.nn.Module):
        return list(model.named_parameters())
    params = list(model)
    if params and isinstance(params[0], tuple):
        return params
    return [("param.%d" % i, p) for i, p in enumerate(params)]


def _check_parameter(name, p):
    if p.dtype != torch.float32:
        raise TypeError("parameter '%s' has dtype %s; dsyncps synchronizes float32 parameters "
                        "(torch.float32): convert the model with model.float(), or freeze the "
                        "parameter (requires_grad=False) to keep it out" % (name, p.dtype))


def _server_optimizer(kind, lr, momentum, dampening, nesterov, weight_decay, betas, eps):
    if kind not in _KINDS:
        raise ValueError("optimizer '%s' is not one of %s" % (kind, ", ".join(_KINDS)))
    for label, v in (("lr", lr), ("momentum", momentum), ("dampening", dampening),
                     ("weight_decay", weight_decay), ("eps", eps)):
        if not math.isfinite(v) or v < 0:
            raise ValueError("%s must be a finite number >= 0, not %r" % (label, v))
    if kind == "sgd" and momentum > 0:
        kind = "momentum"  # torch.optim.SGD with momentum
    if kind == "momentum" and momentum <= 0:
        raise ValueError("the momentum optimizer needs momentum > 0 (got %r)" % momentum)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov momentum requires momentum > 0 and zero dampening "
                         "(as torch.optim.SGD)")
    return {"kind": kind, "lr": float(lr), "momentum": float(momentum),
            "dampening": float(dampening), "nesterov": bool(nesterov),
            "weight_decay": float(weight_decay), "beta1": float(betas[0]),
            "beta2": float(betas[1]), "eps": float(eps)}


class _Slot:
    """One registered parameter and what its transfers need."""

    __slots__ = ("name", "param", "tensor_id", "passes", "pushed", "host_model", "host_grad")

    def __init__(self, name, param):
        self.name = name
        self.param = param
        self.tensor_id = None
        self.passes = 0
        self.pushed = False
        # CUDA parameters travel through pinned host buffers, allocated once; so do
        # non-contiguous ones (a transposed weight), whose memory is not one run of elements.
        self.host_model = None
        self.host_grad = None
        if param.is_cuda:
            self.host_model = torch.empty(param.shape, dtype=torch.float32, pin_memory=True)
            self.host_grad = torch.empty(param.shape, dtype=torch.float32, pin_memory=True)
        elif not param.is_contiguous():
            self.host_model = torch.empty(param.shape, dtype=torch.float32)

    def model_view(self):
        """Where pulls write: the parameter's own memory, or its host mirror."""
        if self.host_model is not None:
            return self.host_model
        return self.param.data

    def grad_view(self):
        g = self.param.grad
        if g.is_sparse:
            g = g.to_dense()
        if self.host_grad is not None:
            self.host_grad.copy_(g)  # synchronous: the push reads it right away
            return self.host_grad
        return g.detach().contiguous()


class ServerOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose update runs on the dsyncps servers.

    ``optimizer``: "sgd" (with ``momentum``, ``dampening``, ``nesterov`` as torch.optim.SGD),
    "momentum" (sgd with momentum), "adam" or "adamw" (``betas``, ``eps``), all with
    ``weight_decay``; "sum" adds every gradient to the parameters (for exactness checks). Parameters are named by ``model.named_parameters()``; every worker must
    build the same model. The first worker's initial values become the model; a worker that
    joins later starts from the servers' current model. ``lr`` changes (``set_lr`` or any
    ``torch.optim.lr_scheduler``) take effect from a round the scheduler picks, alike on
    every server.

    ``backward_passes_per_step``: backward passes that accumulate into one gradient (a
    parameter is pushed after its N-th).
    """

    def __init__(self, model, optimizer="sgd", lr=0.01, momentum=0.0, dampening=0.0,
                 nesterov=False, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8,
                 backward_passes_per_step=1):
        named = _named_parameters(model)
        named = [(n, p) for n, p in named if p.requires_grad]
        if not named:
            raise ValueError("the model has no parameters that require gradients")
        for n, p in named:
            _check_parameter(n, p)
        self._config = _server_optimizer(optimizer, lr, momentum, dampening, nesterov,
                                         weight_decay, betas, eps)
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        super().__init__([p for _, p in named], {"lr": float(lr)})
        self._passes = int(backward_passes_per_step)
        self._slots = [_Slot(n, p) for n, p in named]
        self._lr = float(lr)
        self._requests = []
        self._worker = None
        self._hooks = []
        self._accumulators = []
        if initialized():
            self._join()
        for slot in self._slots:
            self._hook(slot)

    # -- joining -------------------------------------------------------------------------

    def _join(self):
        global _active
        if _active is not None and _active() is not None:
            raise RuntimeError("this process already has a dsyncps ServerOptimizer: a worker "
                               "commits all of its tensors together, so give one "
                               "ServerOptimizer every parameter")
        w = worker()
        pulls = []
        for slot in self._slots:
            init_values = slot.param.detach().to("cpu").contiguous()
            slot.tensor_id = w.register(slot.name, init_values, self._config)
        # Start from the servers' model: the first worker's values, or where a running job
        # has got to by now.
        for slot in self._slots:
            pulls.append(w.pull(slot.tensor_id, slot.model_view()))
        for r in pulls:
            r.wait()
        self._copy_mirrors()
        self._worker = w
        _active = weakref.ref(self)

    def _ready(self):
        if self._worker is None:
            if not initialized():
                raise RuntimeError("dsyncps.init() has not been called: call dsyncps.init() "
                                   "before creating the optimizer or training (it joins the job)")
            self._join()
        return self._worker

    # -- gradients -----------------------------------------------------------------------

    def _hook(self, slot):
        # The gradient accumulator's hook runs once the gradient has been added to .grad
        # (Horovod's and BytePS's way to learn that a parameter's gradient is ready).
        acc = slot.param.expand_as(slot.param).grad_fn.next_functions[0][0]
        self._accumulators.append(acc)
        self._hooks.append(acc.register_hook(lambda *_: self._on_grad(slot)))

    def _on_grad(self, slot):
        if self._worker is None or slot.pushed:
            return
        self._sync_lr()
        slot.passes += 1
        if slot.passes < self._passes:
            return
        grad = slot.grad_view()
        # The pull of the next model is issued with the push and lands once this iteration is
        # committed, which is after the last gradient: the backward pass no longer needs it.
        self._requests.append(self._worker.push_pull(slot.tensor_id, grad, slot.model_view()))
        slot.pushed = True

    def step(self, closure=None):
        """Commits this iteration's gradients and leaves the next model in the parameters."""
        w = self._ready()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_lr()
        missing = [s for s in self._slots if not s.pushed]
        if missing:
            # Parameters without a gradient this step (unused branches, frozen for now) add
            # nothing, as in torch.optim; the iteration still commits.
            self._requests.append(w.advance())
            for slot in missing:
                self._requests.append(w.pull(slot.tensor_id, slot.model_view()))
        requests, self._requests = self._requests, []
        error = None
        for r in requests:
            try:
                r.wait()
            except Exception as e:  # wait for every transfer before the buffers are reused
                error = error or e
        for slot in self._slots:
            slot.passes = 0
            slot.pushed = False
        if error is not None:
            raise error
        self._copy_mirrors()
        return loss

    def zero_grad(self, set_to_none=False):
        self._sync_lr()
        super().zero_grad(set_to_none=set_to_none)

    def _sync_lr(self):
        # An lr scheduler writes param_groups[0]["lr"]; the servers hear of it before this
        # iteration's first push, so the change applies from this iteration's round on.
        if self._worker is not None and self.param_groups[0]["lr"] != self._lr:
            self.set_lr(self.param_groups[0]["lr"])

    def _copy_mirrors(self):
        with torch.no_grad():
            for slot in self._slots:
                if slot.host_model is not None:
                    slot.param.copy_(slot.host_model, non_blocking=False)

    # -- job -----------------------------------------------------------------------------

    def set_lr(self, lr):
        """Changes the servers' learning rate from a round the scheduler picks; returns it."""
        lr = float(lr)
        if not math.isfinite(lr) or lr < 0:
            raise ValueError("lr must be a finite number >= 0, not %r" % lr)
        w = self._ready()
        round_ = w.set_lr(lr)
        self._lr = lr
        for g in self.param_groups:
            g["lr"] = lr
        return round_

    def should_stop(self):
        """The job's budget is spent: finish and leave (dsyncps.shutdown())."""
        return self._worker is not None and self._worker.stop_requested

    @property
    def version(self):
        """The lowest model version among the parameters last pulled."""
        return self._ready().base_version

    def state_dict(self):
        raise NotImplementedError("the optimizer's state lives on the servers; save the model "
                                  "with torch.save(dsyncps.torch.state_dict(model))")

    def load_state_dict(self, state_dict):
        raise NotImplementedError("the optimizer's state lives on the servers")


class Observer:
    """A read-only handle on the job's model: pulls the newest version without holding rounds.

    Use it for evaluation and saving, from a worker or from a process of its own:
        with dsyncps.torch.Observer(model) as ob:
            ob.pull()          # the model's parameters are now the servers' newest
    """

    def __init__(self, model, settings=None):
        self._named = [(n, p) for n, p in _named_parameters(model) if p.requires_grad]
        for n, p in self._named:
            _check_parameter(n, p)
        self._worker = observe(settings)
        self._ids = {}
        for n, p in self._named:
            self._ids[n] = self._worker.register(n, p.detach().to("cpu").contiguous())

    def pull_into(self, tensors):
        """Pulls every parameter into ``tensors`` (name -> tensor); returns the lowest version."""
        versions = []
        host = {}
        requests = []
        for n, tid in self._ids.items():
            t = tensors[n]
            target = t if (t.device.type == "cpu" and t.is_contiguous()) else torch.empty(
                t.shape, dtype=torch.float32)
            host[n] = target
            requests.append(self._worker.pull(tid, target.detach()))
        for r in requests:
            versions.append(r.wait())
        with torch.no_grad():
            for n, target in host.items():
                if target is not tensors[n]:
                    tensors[n].copy_(target)
        return min(versions) if versions else 0

    def pull(self):
        """The servers' newest model into the model's own parameters."""
        return self.pull_into({n: p.data for n, p in self._named})

    @property
    def final_version(self):
        return self._worker.final_version

    def close(self):
        if not self._worker.closed:
            self._worker.leave()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def state_dict(model, observer=None):
    """A regular PyTorch state dict of ``model`` whose parameters are the servers' newest.

    Buffers (batch-norm statistics) are the local module's. ``torch.save`` it as usual.
    """
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    own = observer is None
    ob = observer if observer is not None else Observer(model)
    try:
        ob.pull_into({n: sd[n] for n, _ in ob._named})
    finally:
        if own:
            ob.close()
    return sd
