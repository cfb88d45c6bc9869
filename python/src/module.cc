// dsyncps._core: the framework-neutral Python binding of dsync::Worker. Arrays are taken
// without copying (python/src/array_view.h) and kept alive by the Request of the operation
// until it is waited for; the GIL is released around everything that can block.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <fmt/format.h>

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "array_view.h"
#include "heap.h"
#include "dsync/config.h"
#include "dsync/worker.h"

extern char** environ;

namespace py = pybind11;

namespace dsyncps_py {
namespace {

// Python sees library errors as exceptions of one family (dsyncps.Error, a RuntimeError)
// carrying the StatusCode's name; malformed requests are ValueErrors.
PyObject* g_error = nullptr;

std::string_view CodeName(dsync::StatusCode code) {
  using C = dsync::StatusCode;
  switch (code) {
    case C::kOk: return "ok";
    case C::kInvalidArgument: return "invalid_argument";
    case C::kNotFound: return "not_found";
    case C::kAlreadyExists: return "already_exists";
    case C::kFailedPrecondition: return "failed_precondition";
    case C::kOutOfRange: return "out_of_range";
    case C::kUnavailable: return "unavailable";
    case C::kDeadlineExceeded: return "deadline_exceeded";
    case C::kPermissionDenied: return "permission_denied";
    case C::kProtocol: return "protocol";
    case C::kAborted: return "aborted";
    case C::kInternal: return "internal";
    case C::kUnimplemented: return "unimplemented";
    case C::kResourceExhausted: return "resource_exhausted";
    case C::kDataLoss: return "data_loss";
  }
  return "unknown";
}

void ThrowIfError(const dsync::Status& status) {
  if (status.ok()) return;
  PyObject* type = status.code() == dsync::StatusCode::kInvalidArgument ? PyExc_ValueError : g_error;
  py::object exc = py::reinterpret_steal<py::object>(
      PyObject_CallFunction(type, "s", status.message().c_str()));
  if (!exc) throw py::error_already_set();
  PyObject_SetAttrString(exc.ptr(), "code", py::str(std::string(CodeName(status.code()))).ptr());
  PyErr_SetObject(type, exc.ptr());
  throw py::error_already_set();
}

template <typename T>
T ValueOrThrow(dsync::Result<T> result) {
  ThrowIfError(result.status());
  return std::move(result).value();
}

struct TensorInfo {
  std::string name;
  uint64_t elements = 0;
  std::vector<int64_t> shape;
};

// Shared by a Worker and its Requests, so a Request waited for after its Worker object was
// dropped still finds the connection (and the Worker leaves only once nobody needs it).
struct WorkerState {
  std::unique_ptr<dsync::Worker> worker;
  std::mutex mu;  // guards tensors (pushes come from autograd hooks on other threads)
  std::vector<TensorInfo> tensors;
  bool closed = false;

  dsync::Worker& Get() {
    if (closed || !worker) {
      ThrowIfError(dsync::Status(dsync::StatusCode::kFailedPrecondition,
                                 "this worker has left the job (leave() or abandon() was called); "
                                 "start a new one to take part again"));
    }
    return *worker;
  }
  TensorInfo Tensor(dsync::TensorId id) {
    std::lock_guard lock(mu);
    if (id >= tensors.size()) {
      ThrowIfError(dsync::Status(dsync::StatusCode::kInvalidArgument,
                                 fmt::format("tensor id {} was not registered by this worker ({} are)",
                                             id, tensors.size())));
    }
    return tensors[id];
  }
};

// An operation in flight: wait() returns the version (pulls) and releases the arrays.
class Request {
 public:
  Request(std::shared_ptr<WorkerState> state, dsync::Handle handle, std::vector<ArrayView> arrays)
      : state_(std::move(state)), handle_(handle), arrays_(std::move(arrays)) {}
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request() {
    // The memory must outlive the transfer: an unwaited request waits here (errors are
    // dropped: nobody asked for them).
    if (!done_ && state_->worker && !state_->closed) {
      py::gil_scoped_release release;
      (void)state_->worker->Wait(handle_);
    }
  }

  std::optional<dsync::Version> Wait() {
    if (done_) return version_;
    dsync::Status status;
    dsync::Version version = 0;
    {
      py::gil_scoped_release release;
      status = state_->Get().Wait(handle_, &version);
    }
    done_ = true;
    arrays_.clear();
    ThrowIfError(status);
    version_ = version;
    return version_;
  }
  bool done() const { return done_; }

 private:
  std::shared_ptr<WorkerState> state_;
  dsync::Handle handle_;
  std::vector<ArrayView> arrays_;
  bool done_ = false;
  std::optional<dsync::Version> version_;
};

class Worker {
 public:
  // settings: DSYNC_* names and values over the process environment.
  static std::unique_ptr<Worker> Start(const std::map<std::string, std::string>& settings,
                                       bool observer) {
    std::map<std::string, std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string_view kv(*e);
      const size_t eq = kv.find('=');
      if (eq != std::string_view::npos) env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
    }
    for (const auto& [k, v] : settings) {
      // The RDMA transport's tunables are read from each process's own environment when it
      // starts its transport, and every node must use the same: a settings entry would be
      // ignored on this node alone.
      if (k.starts_with("DSYNC_RDMA_") && k != "DSYNC_RDMA_DEVICE") {
        ThrowIfError(dsync::Status(
            dsync::StatusCode::kInvalidArgument,
            fmt::format("{} is not a setting dsyncps.init() takes: the RDMA transport's "
                        "DSYNC_RDMA_* tunables are read from each process's environment; export "
                        "it for every node alike before `dsyncps launch`",
                        k)));
      }
      env[k] = v;
    }
    // A misspelt or renamed DSYNC_* name would be ignored in silence: Python's warnings say so,
    // pointing at the caller of dsyncps.init() or observe() (stacklevel 2: this C++ function
    // has no frame of its own). The settings passed here are always checked; the inherited
    // environment only where no launcher did (DSYNC_ENV_CHECKED, which `dsyncps launch` and
    // `join` set).
    const std::string checked(dsync::Config::kEnvironmentChecked);
    std::map<std::string, std::string> unchecked = env.contains(checked) ? settings : env;
    unchecked.erase(checked);
    if (const auto unknown = dsync::Config::UnknownVariables(unchecked); !unknown.empty()) {
      const py::object warn = py::module_::import("warnings").attr("warn");
      for (const std::string& w : unknown) warn(w, py::handle(PyExc_RuntimeWarning), 2);
    }
    dsync::Config config = ValueOrThrow(dsync::Config::FromEnvironment(env));
    if (config.role != dsync::Role::kWorker) {
      ThrowIfError(dsync::Status(
          dsync::StatusCode::kInvalidArgument,
          fmt::format("this process's environment makes it the {} (DSYNC_ROLE or its task rank); "
                      "Python processes are workers: start them with `dsyncps launch -- python3 "
                      "SCRIPT` or `dsyncps join -- python3 SCRIPT`",
                      dsync::RoleName(config.role))));
    }
    config.observer = config.observer || observer;
    PinHeap(config.pin_heap);
    auto state = std::make_shared<WorkerState>();
    {
      py::gil_scoped_release release;
      auto started = dsync::Worker::Start(config);
      if (!started.ok()) {
        py::gil_scoped_acquire gil;
        ThrowIfError(started.status());
      }
      state->worker = std::move(started).value();
    }
    return std::unique_ptr<Worker>(new Worker(std::move(state)));
  }

  ~Worker() = default;

  py::dict Job() {
    const dsync::JobInfo& j = state_->Get().job();
    py::dict d;
    d["worker_id"] = j.worker_id;
    d["sync"] = j.sync.ToString();
    d["staleness"] = j.staleness.ToString();
    d["slice_bytes"] = j.slice_bytes;
    d["num_servers"] = j.num_servers;
    d["join_round"] = j.join_round;
    d["start_clock"] = j.start_clock;
    d["observer"] = j.observer;
    py::dict o;
    o["kind"] = std::string(dsync::OptimizerName(j.optimizer.kind));
    o["lr"] = j.optimizer.lr;
    o["momentum"] = j.optimizer.momentum;
    o["beta1"] = j.optimizer.beta1;
    o["beta2"] = j.optimizer.beta2;
    o["eps"] = j.optimizer.eps;
    o["weight_decay"] = j.optimizer.weight_decay;
    o["dampening"] = j.optimizer.dampening;
    o["nesterov"] = j.optimizer.nesterov;
    d["optimizer"] = o;
    return d;
  }

  dsync::TensorId Register(const std::string& name, py::handle init, py::object optimizer) {
    dsync::Worker& w = state_->Get();
    dsync::TensorOptions options;
    if (!optimizer.is_none()) options.optimizer = OptimizerFromDict(name, optimizer.cast<py::dict>());
    ArrayView v = ViewArray(init, fmt::format("tensor '{}'", name), false);
    RefuseCuda(v, fmt::format("tensor '{}'", name));
    for (int64_t d : v.shape) options.shape.push_back(static_cast<uint64_t>(d));
    dsync::TensorId id = 0;
    {
      py::gil_scoped_release release;
      auto r = w.Register(name, std::span<const float>(v.data, v.elements), options);
      py::gil_scoped_acquire gil;
      id = ValueOrThrow(std::move(r));
    }
    std::lock_guard lock(state_->mu);
    if (state_->tensors.size() <= id) state_->tensors.resize(id + 1);
    state_->tensors[id] = {name, v.elements, v.shape};
    return id;
  }

  std::unique_ptr<Request> Push(dsync::TensorId id, py::handle grad) {
    ArrayView g = Checked(id, grad, "gradient", false);
    dsync::Handle h;
    {
      py::gil_scoped_release release;
      h = state_->Get().Push(id, g.data);
    }
    return MakeRequest(h, {std::move(g)});
  }

  std::unique_ptr<Request> Pull(dsync::TensorId id, py::handle out) {
    ArrayView o = Checked(id, out, "model", true);
    dsync::Handle h;
    {
      py::gil_scoped_release release;
      h = state_->Get().Pull(id, o.data);
    }
    return MakeRequest(h, {std::move(o)});
  }

  std::unique_ptr<Request> PushPull(dsync::TensorId id, py::handle grad, py::handle out) {
    ArrayView g = Checked(id, grad, "gradient", false);
    ArrayView o = Checked(id, out, "model", true);
    dsync::Handle h;
    {
      py::gil_scoped_release release;
      h = state_->Get().PushPull(id, g.data, o.data);
    }
    std::vector<ArrayView> arrays;
    arrays.push_back(std::move(g));
    arrays.push_back(std::move(o));
    return MakeRequest(h, std::move(arrays));
  }

  std::unique_ptr<Request> Advance() {
    dsync::Handle h;
    {
      py::gil_scoped_release release;
      h = state_->Get().Advance();
    }
    return MakeRequest(h, {});
  }

  dsync::Round SetLearningRate(double lr) {
    dsync::Worker& w = state_->Get();
    dsync::Result<dsync::Round> r = dsync::Error(dsync::StatusCode::kInternal, "not run");
    {
      py::gil_scoped_release release;
      r = w.SetLearningRate(static_cast<float>(lr));
    }
    return ValueOrThrow(std::move(r));
  }

  void WaitAll() {
    dsync::Status st;
    {
      py::gil_scoped_release release;
      st = state_->Get().WaitAll();
    }
    ThrowIfError(st);
  }

  void Leave() {
    if (state_->closed) return;
    dsync::Status st;
    {
      py::gil_scoped_release release;
      st = state_->worker->Leave();
    }
    state_->closed = true;
    ThrowIfError(st);
  }

  void Abandon() {
    if (state_->closed) return;
    py::gil_scoped_release release;
    state_->worker->Abandon();
    state_->closed = true;
  }

  bool StopRequested() { return state_->Get().stop_requested(); }
  std::optional<dsync::Version> FinalVersion() { return state_->Get().final_version(); }
  dsync::Clock ClockNow() { return state_->Get().clock(); }
  dsync::Version BaseVersion() { return state_->Get().base_version(); }
  bool closed() const { return state_->closed; }

  py::list Tensors() {
    std::lock_guard lock(state_->mu);
    py::list out;
    for (const TensorInfo& t : state_->tensors) {
      out.append(py::make_tuple(t.name, py::tuple(py::cast(t.shape))));
    }
    return out;
  }

 private:
  explicit Worker(std::shared_ptr<WorkerState> state) : state_(std::move(state)) {}

  // {"kind": "adam", "lr": 0.001, ...}: torch.optim's names; what is left out keeps the
  // defaults of OptimizerConfig. Unknown keys are refused (a typo would silently not apply).
  static dsync::OptimizerConfig OptimizerFromDict(const std::string& name, const py::dict& d) {
    dsync::OptimizerConfig o;
    for (auto [key_obj, value] : d) {
      const std::string key = py::str(key_obj);
      if (key == "kind") {
        o.kind = ValueOrThrow(dsync::ParseOptimizer(value.cast<std::string>()));
      } else if (key == "nesterov") {
        o.nesterov = value.cast<bool>();
      } else {
        float* field = key == "lr" ? &o.lr : key == "momentum" ? &o.momentum
                     : key == "dampening" ? &o.dampening : key == "beta1" ? &o.beta1
                     : key == "beta2" ? &o.beta2 : key == "eps" ? &o.eps
                     : key == "weight_decay" ? &o.weight_decay : nullptr;
        if (field == nullptr) {
          ThrowIfError(dsync::Status(dsync::StatusCode::kInvalidArgument,
                                     fmt::format("tensor '{}': unknown optimizer setting '{}' (kind, "
                                                 "lr, momentum, dampening, nesterov, beta1, beta2, "
                                                 "eps, weight_decay)", name, key)));
        }
        *field = static_cast<float>(value.cast<double>());
      }
    }
    ThrowIfError(dsync::ValidateOptimizer(o));
    return o;
  }

  // Public for the module's _check_array.
 public:
  static void RefuseCuda(const ArrayView& v, const std::string& name) {
    if (!v.on_cuda) return;
    PyErr_SetString(PyExc_TypeError,
                    fmt::format("{} is in CUDA memory (device {}); the core takes host "
                                "memory: pass tensor.cpu(), or use dsyncps.torch, which stages "
                                "CUDA tensors through pinned host buffers", name, v.device_id)
                        .c_str());
    throw py::error_already_set();
  }

 private:
  // The array must hold exactly the registered tensor's elements: the transports read and
  // write that many from the pointer.
  ArrayView Checked(dsync::TensorId id, py::handle obj, const char* what, bool writable) {
    const TensorInfo t = state_->Tensor(id);
    ArrayView v = ViewArray(obj, fmt::format("the {} of tensor '{}'", what, t.name), writable);
    RefuseCuda(v, fmt::format("tensor '{}'", t.name));
    if (v.elements != t.elements) {
      PyErr_SetString(PyExc_ValueError,
                      fmt::format("the {} of tensor '{}' has shape {} ({} elements); the tensor "
                                  "was registered with shape {} ({} elements)", what, t.name,
                                  ShapeText(v.shape), v.elements, ShapeText(t.shape), t.elements)
                          .c_str());
      throw py::error_already_set();
    }
    return v;
  }

  std::unique_ptr<Request> MakeRequest(dsync::Handle h, std::vector<ArrayView> arrays) {
    return std::make_unique<Request>(state_, h, std::move(arrays));
  }

  std::shared_ptr<WorkerState> state_;
};

}  // namespace
}  // namespace dsyncps_py

PYBIND11_MODULE(_core, m) {
  using namespace dsyncps_py;
  m.doc() = "dsyncps core: a worker of a dsyncps parameter-server job";
  static py::exception<void> error(m, "Error", PyExc_RuntimeError);
  g_error = error.ptr();

  m.def("_check_array", [](py::handle obj, const std::string& what) {
    ArrayView v = ViewArray(obj, what, false);
    Worker::RefuseCuda(v, what);
    return py::tuple(py::cast(v.shape));
  }, "Views an array as dsyncps would (for tests): its shape, or the error a transfer would raise.");

  m.def("heap_state", &HeapState,
        "What dsyncps did with glibc's heap thresholds when this process's worker started "
        "(DSYNC_PIN_HEAP; docs/python.md).");
  // The pinned values, for a process that should run with the same ones without dsyncps
  // (bench/python/cnn_vs_ddp.py's DDP baseline).
  m.attr("PINNED_HEAP_ENV") = py::dict(
      py::arg("MALLOC_MMAP_THRESHOLD_") = std::to_string(kPinnedMmapThreshold),
      py::arg("MALLOC_TRIM_THRESHOLD_") = std::to_string(kPinnedTrimThreshold));

  py::class_<Request>(m, "Request", "an operation in flight; wait() completes it")
      .def("wait", &Request::Wait,
           "Waits for the operation; returns the model version for pulls (None otherwise). "
           "The arrays it uses are released afterwards.")
      .def_property_readonly("done", &Request::done);

  py::class_<Worker>(m, "Worker", "a worker (or an observer) of a running job")
      .def_static("start", &Worker::Start, py::arg("settings") = std::map<std::string, std::string>{},
                  py::arg("observer") = false,
                  "Joins the job the DSYNC_* environment (overridden by `settings`) names.")
      .def_property_readonly("job", &Worker::Job)
      .def("register", &Worker::Register, py::arg("name"), py::arg("init"),
           py::arg("optimizer") = py::none(),
           "Registers a float32 tensor; the first registration's values become the model.")
      .def("push", &Worker::Push, py::arg("tensor"), py::arg("grad"))
      .def("pull", &Worker::Pull, py::arg("tensor"), py::arg("out"))
      .def("push_pull", &Worker::PushPull, py::arg("tensor"), py::arg("grad"), py::arg("out"))
      .def("advance", &Worker::Advance, "commits this clock with what was pushed")
      .def("set_lr", &Worker::SetLearningRate, py::arg("lr"),
           "Changes every tensor's learning rate on the servers from a round the scheduler "
           "picks (the same on every server); returns that round.")
      .def("wait_all", &Worker::WaitAll)
      .def("leave", &Worker::Leave)
      .def("abandon", &Worker::Abandon)
      .def_property_readonly("stop_requested", &Worker::StopRequested)
      .def_property_readonly("final_version", &Worker::FinalVersion)
      .def_property_readonly("clock", &Worker::ClockNow)
      .def_property_readonly("base_version", &Worker::BaseVersion)
      .def_property_readonly("closed", &Worker::closed)
      .def_property_readonly("tensors", &Worker::Tensors);
}
