// The places where the CUDA back end's host code needs nvcc and a CUDA build of torch:
// kernel launches, the dispatcher registration of the CUDA kernels, and that of the
// back end's settings. Each is a macro with its usual meaning unless the includer
// defined it first: that is how tests/cuda_emulator compiles these sources unmodified
// with g++ and runs the kernels on the CPU (its launch runs every CUDA thread as a
// fiber; its registrations bind the same kernels to CPU tensors, and the settings to
// its own copy of the back end, while a test asks for them).
#pragma once

// HETCOMM_LAUNCH(kernel, grid, block, shared_bytes, stream)(args...)
#ifndef HETCOMM_LAUNCH
#define HETCOMM_LAUNCH(kernel, grid, block, shared_bytes, stream) kernel<<<grid, block, shared_bytes, stream>>>
#endif

// HETCOMM_CUDA_REGISTRATION(m) { m.impl("op", &op_cuda); ... }
#ifndef HETCOMM_CUDA_REGISTRATION
#define HETCOMM_CUDA_REGISTRATION(m) TORCH_LIBRARY_IMPL(hetcomm, CUDA, m)
#endif

// HETCOMM_CUDA_SETTINGS_REGISTRATION(m) { m.impl("_set_launch_shape", ...); ... }: ops
// with no tensor argument, which the dispatcher sends to CompositeExplicitAutograd.
#ifndef HETCOMM_CUDA_SETTINGS_REGISTRATION
#define HETCOMM_CUDA_SETTINGS_REGISTRATION(m) TORCH_LIBRARY_IMPL(hetcomm, CompositeExplicitAutograd, m)
#endif
