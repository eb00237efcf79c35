// How many blocks the multi-tensor kernels launch and how many groups each thread
// keeps in flight, per compute capability (the table is in launch_shape.cu).
#pragma once

namespace hetcomm::cuda {

struct LaunchShape {
  int blocks_per_sm;
  int items_per_thread;  // 2 or 4: the kernels are instantiated for these two
};

// The table entry for a compute capability; unknown (newer) ones get a shape derived
// from the SM's thread capacity.
LaunchShape launch_shape_for(int major, int minor, int max_threads_per_sm);

struct DeviceLaunch {
  int sm_count;
  LaunchShape shape;
};

// The shape for a device, from its attributes, read once per device and cached.
DeviceLaunch device_launch(int device);

}  // namespace hetcomm::cuda
