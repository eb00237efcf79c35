#include "cuda/launch_shape.h"

#include "kernels/launch_args.h"

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <mutex>
#include <optional>
#include <unordered_map>

namespace hetcomm::cuda {
namespace {

// The shapes read per device and the override, behind one lock: device_launch takes it
// on every call anyway, so checking for an override costs the normal path one branch.
struct Shapes {
  std::mutex mutex;
  std::unordered_map<int, DeviceLaunch> by_device;
  std::optional<LaunchShape> override_shape;
};

Shapes& shapes() {
  static Shapes instance;
  return instance;
}

}  // namespace

// The kernels are memory-bound: a launch is fast when every SM keeps enough bytes in
// flight to cover the memory latency (Little's law: bandwidth per SM x ~0.5 us, i.e.
// 6-10 KB per SM on these GPUs). An item is one group load per thread (16 bytes, or
// 32 for fp32 beside a 16-bit type) issued before any is used. The kernels need 40-64
// registers (ptxas -v), so an SM keeps 1024-1536 of their threads resident whatever
// it could hold; blocks_per_sm asks for the SM's thread capacity and the launcher caps
// it at what the compiled kernel can keep resident, so that the grid is one wave.
//
// These entries are reasoned, not measured: the only GPU run so far (an H200, sm_90,
// benchmarks/results/ops_cuda_h200.md) took the default branch's {8, 2} and reached
// 33-81% of the same run's copy bandwidth at 256M elements. benchmarks/sweep_launch.py
// times every op over blocks per SM x items per thread against the same run's copy:
// once it has run on a GPU, re-derive this table from its result (the bytes in flight
// per SM that reach copy bandwidth there, against each card's bandwidth-latency
// product, since the legacy cards themselves are not lent) and name the result here.
LaunchShape launch_shape_for(int major, int minor, int max_threads_per_sm) {
  switch (major * 10 + minor) {
    case 60:  // P100: 56 SMs, 732 GB/s (~13 GB/s per SM), 2048 threads/SM. 2 items on
              // ~1024 resident threads put >= 32 KB in flight per SM, 5x the need;
              // more would only add registers.
      return {8, 2};
    case 61:  // GTX 1080 Ti, Titan Xp, P40, P4: 20-30 SMs, up to 548 GB/s (~18 GB/s per
              // SM, ~9 KB needed); 2048 threads/SM as on P100.
      return {8, 2};
    case 70:  // V100: 80 SMs, 900 GB/s (~11 GB/s per SM), 2048 threads/SM.
      return {8, 2};
    case 75:  // T4, RTX 2080 Ti: at most 1024 threads per SM (4 blocks), so each thread
              // keeps 4 loads in flight to match what Pascal/Volta reach with 2.
      return {4, 4};
    case 80:  // A100: 108 SMs, 1555-2039 GB/s (~19 GB/s per SM, ~10 KB needed),
              // 2048 threads/SM: 2 items on the resident threads cover it twice over.
      return {8, 2};
    case 86:  // RTX 3090, A40, A10: 1536 threads per SM (6 blocks), ~11 GB/s per SM.
      return {6, 2};
    default:  // Newer or unlisted: fill the SM; more loads per thread where it holds few threads.
      return {max_threads_per_sm / kernels::kThreads, max_threads_per_sm <= 1024 ? 4 : 2};
  }
}

DeviceLaunch device_launch(int device) {
  Shapes& state = shapes();
  const std::lock_guard<std::mutex> lock(state.mutex);
  auto found = state.by_device.find(device);
  if (found == state.by_device.end()) {
    int major = 0;
    int minor = 0;
    int sms = 0;
    int threads = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&threads, cudaDevAttrMaxThreadsPerMultiProcessor, device));
    found = state.by_device.emplace(device, DeviceLaunch{sms, launch_shape_for(major, minor, threads)}).first;
  }
  DeviceLaunch launch = found->second;
  if (state.override_shape.has_value()) {
    launch.shape = *state.override_shape;
  }
  return launch;
}

void override_launch_shape(int64_t blocks_per_sm, int64_t items_per_thread) {
  TORCH_CHECK_VALUE(blocks_per_sm >= 1 && blocks_per_sm <= kMaxBlocksPerSm,
                    "hetcomm._set_launch_shape: blocks_per_sm must be 1 to ", kMaxBlocksPerSm, "; got ",
                    blocks_per_sm);
  TORCH_CHECK_VALUE(items_per_thread == 2 || items_per_thread == 4,
                    "hetcomm._set_launch_shape: items_per_thread must be 2 or 4 (the kernels are instantiated "
                    "for these); got ",
                    items_per_thread);
  Shapes& state = shapes();
  const std::lock_guard<std::mutex> lock(state.mutex);
  state.override_shape = LaunchShape{static_cast<int>(blocks_per_sm), static_cast<int>(items_per_thread)};
}

void clear_launch_shape_override() {
  Shapes& state = shapes();
  const std::lock_guard<std::mutex> lock(state.mutex);
  state.override_shape.reset();
}

}  // namespace hetcomm::cuda
