// Which math a training worker runs: the CPU Mlp (OpenBLAS) or GpuMlp (cuBLAS), picked by
// `--worker-math cpu|cuda|auto`.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "dsync/status.h"
#include "mlp.h"

namespace dsync::train {

enum class MlpMathKind { kCpu, kCuda, kAuto };

Result<MlpMathKind> ParseMlpMath(std::string_view text);  // "cpu" | "cuda" | "auto"
std::string_view MlpMathName(MlpMathKind kind);

// Whether this build has the GPU math (nvcc and cuBLAS were found when it was configured).
bool BuildHasCudaMath();

// Loads what the GPU math needs besides a device (cuBLAS, opened at run time); no device is
// touched. An error says what is missing.
Status LoadCudaMathLibraries();

// auto -> cuda when a device is visible and cuBLAS loads, else cpu; cuda -> an error that says
// what to do when the build has no CUDA, no device is visible or cuBLAS does not load. Call it
// before joining a job, so a bad choice fails before training starts.
Result<MlpMathKind> ResolveMlpMath(MlpMathKind requested);

// The GPU implementation with device buffers for `max_batch` samples; the same errors as
// ResolveMlpMath(kCuda) when it cannot run here.
Result<std::unique_ptr<MlpMath>> MakeCudaMlp(const std::vector<uint32_t>& sizes,
                                             uint32_t max_batch);

}  // namespace dsync::train
