// Runs adamw_'s segment list on a CUDA stream: parameters grouped by (gradient, copy)
// dtype pair, up to kernels::kMaxAdamWSegments per launch in the kernel's arguments, or
// all of a pair at once from a device table when a long list recurs
// (cuda/device_tables.h). Launches only: nothing here waits for the GPU.
#pragma once

#include "kernels/adamw_math.h"
#include "ops/adamw_segment.h"

#include <c10/core/Device.h>
#include <cuda_runtime_api.h>

namespace hetcomm::cuda {

// grad_scale, found_inf, step: device scalars. The segments live on `device`, which is
// the current device.
void run_adamw(const AdamWSegmentList& segments, const AdamWHyper& hyper, const float* grad_scale,
               const float* found_inf, const float* step, const c10::Device& device, cudaStream_t stream);

}  // namespace hetcomm::cuda
