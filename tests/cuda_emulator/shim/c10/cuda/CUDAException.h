// Stand-in for c10/cuda/CUDAException.h. A failed emulated launch throws from the
// launch itself, so there is no deferred launch error for the check to find.
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#define C10_CUDA_CHECK(EXPR)                                                                 \
  do {                                                                                       \
    const cudaError_t hetemu_error = (EXPR);                                                 \
    TORCH_CHECK(hetemu_error == cudaSuccess, "CUDA error: ", cudaGetErrorString(hetemu_error)); \
  } while (0)

#define C10_CUDA_KERNEL_LAUNCH_CHECK() \
  do {                                 \
  } while (0)
