// The grid of one wave for a kernel of the multi-tensor walk: the device's SMs times the
// launch shape's blocks per SM, capped at the blocks of that kernel an SM can keep
// resident (known once the compiler fixed its registers; read once per device and
// kernel). Blocks stride over a launch's chunks, so more would only wait.
#pragma once

#include "cuda/launch_shape.h"
#include "kernels/launch_args.h"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

namespace hetcomm::cuda {

template <typename Kernel>
int max_grid(Kernel kernel, int device) {
  static std::mutex mutex;
  static std::map<std::pair<int, Kernel>, int> resident;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, kernel);
  auto found = resident.find(key);
  if (found == resident.end()) {
    int blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kernels::kThreads, 0));
    found = resident.emplace(key, std::max(blocks, 1)).first;
  }
  const DeviceLaunch launch = device_launch(device);
  return launch.sm_count * std::min(launch.shape.blocks_per_sm, found->second);
}

}  // namespace hetcomm::cuda
