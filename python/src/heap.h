// glibc's heap thresholds for a Python worker. A CPU backward pass allocates and frees
// tensors of the parameters' size every step; in a Python process glibc hands much of that
// memory back to the kernel at each free (its top is trimmed, large blocks are unmapped) and
// the next step faults it in again, page by page: 100-150 faults per step for a 1 M-parameter
// model, about half of all CPU time of a small CNN's workers on a 2-core VM
// (docs/benchmarks.md). Pinning the thresholds keeps that memory in the process.
#pragma once

#include <string>

namespace dsyncps_py {

// Pins the thresholds unless `wanted` is false, the user chose heap settings of their own
// (MALLOC_*_ variables, GLIBC_TUNABLES with glibc.malloc.*), or the C library is not glibc.
// Returns what was done, as HeapState() says it afterwards.
std::string PinHeap(bool wanted);
// "pinned (...)", "left to glibc (why)", or "not asked yet" before any worker started.
std::string HeapState();

}  // namespace dsyncps_py
