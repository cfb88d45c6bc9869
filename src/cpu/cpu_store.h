// Host-memory ParamStore: slices in page-aligned host buffers, rounds applied by plain loops
// over the shared optimizer math (ps/optimizer_math.h).
#pragma once

#include <memory>

#include "ps/param_store.h"

namespace dsync::cpu {

std::unique_ptr<ps::ParamStore> MakeCpuStore();

}  // namespace dsync::cpu
