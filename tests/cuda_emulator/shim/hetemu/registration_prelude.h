// Included first in csrc/cuda/ops_cuda.cu (g++ -include): its CUDA registration block
// becomes a function that src/module.cpp calls with a library of its own, which binds
// the kernels to CPU tensors while the tests ask for the emulated GPU.
#pragma once

namespace torch {
class Library;
}

#define HETCOMM_CUDA_REGISTRATION(m) void register_emulated_kernels(torch::Library& m)
