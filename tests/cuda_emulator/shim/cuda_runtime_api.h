// Stand-in for <cuda_runtime_api.h>: the runtime calls of the CUDA back end's
// launchers, answered for the emulated GPU of this build (src/device.cpp).
#pragma once

#include <cstddef>

typedef struct CUstream_st* cudaStream_t;

enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1 };

enum cudaDeviceAttr {
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMaxThreadsPerMultiProcessor = 39,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
};

namespace hetemu {

struct EmulatedDevice {
  int cc_major;
  int cc_minor;
  int sm_count;
  int max_threads_per_sm;
  int resident_blocks;  // what the occupancy calculator answers for every kernel
};

const EmulatedDevice& emulated_device();

}  // namespace hetemu

inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int /*device*/) {
  const hetemu::EmulatedDevice& d = hetemu::emulated_device();
  switch (attr) {
    case cudaDevAttrMultiProcessorCount:
      *value = d.sm_count;
      return cudaSuccess;
    case cudaDevAttrMaxThreadsPerMultiProcessor:
      *value = d.max_threads_per_sm;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor:
      *value = d.cc_major;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor:
      *value = d.cc_minor;
      return cudaSuccess;
  }
  return cudaErrorInvalidValue;
}

template <typename Kernel>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel /*kernel*/, int /*threads*/,
                                                          std::size_t /*shared_bytes*/) {
  *blocks = hetemu::emulated_device().resident_blocks;
  return cudaSuccess;
}

// Launches run at once on the CPU: nothing is ever captured into a graph.
enum cudaStreamCaptureStatus { cudaStreamCaptureStatusNone = 0, cudaStreamCaptureStatusActive = 1 };

inline cudaError_t cudaStreamIsCapturing(cudaStream_t /*stream*/, cudaStreamCaptureStatus* status) {
  *status = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

inline const char* cudaGetErrorString(cudaError_t error) {
  return error == cudaSuccess ? "no error" : "invalid argument";
}
