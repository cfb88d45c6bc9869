#include "array_view.h"

#include <dlpack/dlpack.h>
#include <fmt/format.h>

namespace py = pybind11;

namespace dsyncps_py {
namespace {

std::string DTypeText(const DLDataType& t) {
  const char* kind = t.code == kDLFloat ? "float" : t.code == kDLInt ? "int" : t.code == kDLUInt ? "uint"
                   : t.code == kDLBfloat ? "bfloat" : "other";
  return fmt::format("{}{}{}", kind, t.bits, t.lanes > 1 ? fmt::format("x{}", t.lanes) : "");
}

[[noreturn]] void Raise(PyObject* type, const std::string& message) {
  PyErr_SetString(type, message.c_str());
  throw py::error_already_set();
}

constexpr const char* kSupported = "dsyncps transfers float32 arrays (torch.float32, numpy.float32)";

ArrayView FromDlpack(py::handle obj, const std::string& what) {
  py::object capsule = obj.attr("__dlpack__")();
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (managed == nullptr) throw py::error_already_set();
  // The consumer owns the tensor from here: rename the capsule so its destructor does not
  // free it too (the DLPack protocol's rule), and call the deleter when done with it.
  PyCapsule_SetName(capsule.ptr(), "used_dltensor");
  std::shared_ptr<void> owner(managed, [](void* p) {
    auto* m = static_cast<DLManagedTensor*>(p);
    if (m->deleter != nullptr) {
      py::gil_scoped_acquire gil;  // deleters of Python producers touch Python objects
      m->deleter(m);
    }
  });
  const DLTensor& t = managed->dl_tensor;
  ArrayView v;
  v.shape.assign(t.shape, t.shape + t.ndim);
  if (t.dtype.code != kDLFloat || t.dtype.bits != 32 || t.dtype.lanes != 1) {
    Raise(PyExc_TypeError, fmt::format("{} has dtype {}; {}. Convert it (tensor.float()) or keep "
                                       "it out of what dsyncps synchronizes", what, DTypeText(t.dtype), kSupported));
  }
  uint64_t n = 1;
  int64_t expected = 1;
  bool contiguous = true;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.strides != nullptr && t.shape[i] > 1 && t.strides[i] != expected) contiguous = false;
    expected *= t.shape[i];
    n *= static_cast<uint64_t>(t.shape[i]);
  }
  if (!contiguous) {
    Raise(PyExc_ValueError, fmt::format("{} is not contiguous (shape {}); pass tensor.contiguous() "
                                        "or numpy.ascontiguousarray(a)", what, ShapeText(v.shape)));
  }
  switch (t.device.device_type) {
    case kDLCPU:
    case kDLCUDAHost: break;
    case kDLCUDA:
    case kDLCUDAManaged: v.on_cuda = true; break;
    default:
      Raise(PyExc_TypeError, fmt::format("{} lives on DLPack device type {}, which dsyncps cannot "
                                         "read; move it to the CPU or a CUDA GPU", what,
                                         static_cast<int>(t.device.device_type)));
  }
  v.device_id = t.device.device_id;
  v.data = reinterpret_cast<float*>(static_cast<char*>(t.data) + t.byte_offset);
  v.elements = n;
  v.owner = std::move(owner);
  return v;
}

ArrayView FromBuffer(py::handle obj, const std::string& what, bool writable) {
  auto buffer = std::make_shared<Py_buffer>();
  const int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj.ptr(), buffer.get(), flags) != 0) {
    PyErr_Clear();
    if (writable && PyObject_CheckBuffer(obj.ptr())) {
      Raise(PyExc_ValueError, fmt::format("{} is read-only; dsyncps writes the model into it", what));
    }
    Raise(PyExc_TypeError, fmt::format("{} is a {}, which is no array: pass a torch tensor, a "
                                       "numpy array or another object with __dlpack__ or the "
                                       "buffer protocol", what, py::str(obj.get_type().attr("__name__")).cast<std::string>()));
  }
  std::shared_ptr<void> owner(buffer.get(), [buffer](void*) mutable {
    py::gil_scoped_acquire gil;
    PyBuffer_Release(buffer.get());
  });
  ArrayView v;
  v.shape.assign(buffer->shape, buffer->shape + buffer->ndim);
  const std::string format = buffer->format != nullptr ? buffer->format : "B";
  if (buffer->itemsize != 4 || (format != "f" && format != "<f" && format != "=f")) {
    Raise(PyExc_TypeError, fmt::format("{} has element format '{}' ({} bytes); {}", what, format,
                                       buffer->itemsize, kSupported));
  }
  if (!PyBuffer_IsContiguous(buffer.get(), 'C')) {
    Raise(PyExc_ValueError, fmt::format("{} is not contiguous (shape {}); pass "
                                        "numpy.ascontiguousarray(a)", what, ShapeText(v.shape)));
  }
  v.data = static_cast<float*>(buffer->buf);
  v.elements = static_cast<uint64_t>(buffer->len / 4);
  v.owner = std::move(owner);
  return v;
}

}  // namespace

ArrayView ViewArray(py::handle obj, const std::string& what, bool writable) {
  if (py::hasattr(obj, "__dlpack__")) {
    try {
      return FromDlpack(obj, what);
    } catch (py::error_already_set& e) {
      // NumPy will not export a read-only array through DLPack (which cannot say read-only);
      // the buffer protocol can, and reading is all a push needs.
      if (!e.matches(PyExc_BufferError) || !PyObject_CheckBuffer(obj.ptr())) throw;
    }
  }
  return FromBuffer(obj, what, writable);
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  if (shape.size() == 1) return fmt::format("({},)", shape[0]);
  return fmt::format("({})", fmt::join(shape, ", "));
}

}  // namespace dsyncps_py
