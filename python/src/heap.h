// glibc's heap thresholds for a Python worker. A CPU backward pass allocates and frees
// tensors of the parameters' size every step; in a Python process glibc hands much of that
// memory back to the kernel at each free (its top is trimmed, large blocks are unmapped) and
// the next step faults it in again, page by page: 100-150 faults per step for a 1 M-parameter
// model, about half of all CPU time of a small CNN's workers on a 2-core VM
// (docs/benchmarks.md). Pinning the thresholds keeps that memory in the process.
#pragma once

#include <string>

namespace dsyncps_py {

// Blocks up to this size come from the heap and are reused; larger ones are still mapped
// anew each time. 32 MiB is glibc's own ceiling for its adaptive threshold on 64-bit
// (DEFAULT_MMAP_THRESHOLD_MAX, malloc/malloc.c), which every glibc's mallopt accepts.
constexpr int kPinnedMmapThreshold = 32 << 20;
// Freed memory at the heap's top is kept up to this much (glibc's default is 128 KiB, or
// twice the adaptive mmap threshold): what a step's temporaries need, with room to spare.
constexpr int kPinnedTrimThreshold = 256 << 20;

// Pins the thresholds unless `wanted` is false, the user chose heap settings of their own
// (MALLOC_*_ variables, GLIBC_TUNABLES with glibc.malloc.*), or the C library is not glibc.
// HeapState() says afterwards what was done.
void PinHeap(bool wanted);
// "pinned (...)", "left to glibc (why)", or "not asked yet" before any worker started.
std::string HeapState();

}  // namespace dsyncps_py
