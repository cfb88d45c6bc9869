// What the Python core sees of an array it is handed: a pointer to float32 elements, their
// count and shape, where they live, and an owner that keeps the memory alive until the
// transfer that uses it has completed. Arrays come through DLPack (PyTorch tensors, NumPy,
// CuPy, JAX: anything with __dlpack__) or, failing that, Python's buffer protocol.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dsyncps_py {

struct ArrayView {
  float* data = nullptr;
  uint64_t elements = 0;
  std::vector<int64_t> shape;
  bool on_cuda = false;  // data is CUDA device memory (DLPack kDLCUDA / kDLCUDAManaged)
  int device_id = 0;
  // Whatever keeps `data` valid: the DLPack tensor (its deleter runs when the last
  // reference goes) or the buffer. Released only once the operation was waited for.
  std::shared_ptr<void> owner;
};

// Views `obj` as float32 elements. `what` names the array in errors ("tensor 'fc.weight'"),
// which raise TypeError (wrong dtype or kind of object) or ValueError (not contiguous,
// read-only where it is written) saying what to pass instead.
ArrayView ViewArray(pybind11::handle obj, const std::string& what, bool writable);

// "(3, 4)": shapes as Python prints them, for messages.
std::string ShapeText(const std::vector<int64_t>& shape);

}  // namespace dsyncps_py
