// The two places where the CUDA back end's host code needs nvcc and a CUDA build of
// torch: kernel launches and the dispatcher registration of the CUDA kernels. Each is a
// macro with its usual meaning unless the includer defined it first: that is how
// tests/cuda_emulator compiles these sources unmodified with g++ and runs the kernels on
// the CPU (its launch runs every CUDA thread as a fiber; its registration binds the same
// kernels to CPU tensors while a test asks for them).
#pragma once

// HETCOMM_LAUNCH(kernel, grid, block, shared_bytes, stream)(args...)
#ifndef HETCOMM_LAUNCH
#define HETCOMM_LAUNCH(kernel, grid, block, shared_bytes, stream) kernel<<<grid, block, shared_bytes, stream>>>
#endif

// HETCOMM_CUDA_REGISTRATION(m) { m.impl("op", &op_cuda); ... }
#ifndef HETCOMM_CUDA_REGISTRATION
#define HETCOMM_CUDA_REGISTRATION(m) TORCH_LIBRARY_IMPL(hetcomm, CUDA, m)
#endif
