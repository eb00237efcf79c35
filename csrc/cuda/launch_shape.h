// How many blocks the multi-tensor kernels launch and how many groups each thread
// keeps in flight, per compute capability (the table is in launch_shape.cu).
#pragma once

#include <cstdint>

namespace hetcomm::cuda {

struct LaunchShape {
  int blocks_per_sm;
  int items_per_thread;  // 2 or 4: the kernels are instantiated for these two
};

// No SM of compute capability 6.0 to 9.0 keeps more blocks resident.
constexpr int kMaxBlocksPerSm = 32;

// The table entry for a compute capability; unknown (newer) ones get a shape derived
// from the SM's thread capacity.
LaunchShape launch_shape_for(int major, int minor, int max_threads_per_sm);

struct DeviceLaunch {
  int sm_count;
  LaunchShape shape;
};

// The shape for a device, from its attributes, read once per device and cached; the
// override's shape while one is set.
DeviceLaunch device_launch(int device);

// Every device's shape from now on, in place of the table's, until
// clear_launch_shape_override(): for benchmarks/sweep_launch.py, which times the
// kernels at shapes the table could hold (torch.ops.hetcomm._set_launch_shape). The
// launcher still caps blocks per SM at what an SM keeps resident of the kernel.
// Refuses, naming the argument, blocks_per_sm outside 1..kMaxBlocksPerSm and
// items_per_thread other than 2 and 4.
void override_launch_shape(int64_t blocks_per_sm, int64_t items_per_thread);
void clear_launch_shape_override();

}  // namespace hetcomm::cuda
