// Runs y = cast(float(x) * scale) over a segment list on a CUDA stream: segments are
// grouped by dtype pair and handed to the multi-tensor kernel up to
// kernels::kMaxSegments at a time in its arguments, or all of a pair at once from a
// device table when a long list recurs (cuda/device_tables.h). Launches only: nothing
// here waits for the GPU.
#pragma once

#include "kernels/launch_args.h"
#include "ops/segment.h"

#include <c10/core/Device.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace hetcomm::cuda {

using kernels::Work;

// The number of chunks, and so of sum-of-squares partials, run_segments will write.
int64_t count_chunks(const SegmentList& segments);

// scale: device scalar, or null for 1. found_inf: device flag, set to 1 when the work
// checks and finds a non-finite value. partials: count_chunks(segments) doubles when
// work is kScaleCastCheckOutputSumSq, else null. The segments live on `device`, which
// is the current device.
void run_segments(const SegmentList& segments, const float* scale, Work work, float* found_inf, double* partials,
                  const c10::Device& device, cudaStream_t stream);

// sq_norm += float(sum of partials[0..count)), in a fixed order (one small launch).
void add_sum_of_squares(const double* partials, int64_t count, float* sq_norm, cudaStream_t stream);

}  // namespace hetcomm::cuda
