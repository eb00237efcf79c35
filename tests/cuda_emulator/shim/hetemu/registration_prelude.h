// Included first in csrc/cuda/ops_cuda.cu (g++ -include): its CUDA registration blocks
// become functions that src/module.cpp calls with libraries of its own, which bind the
// kernels to CPU tensors, and the settings (the launch-shape override) to this
// emulated GPU's copy of the back end, while the tests ask for the emulated GPU.
#pragma once

namespace torch {
class Library;
}

#define HETCOMM_CUDA_REGISTRATION(m) void register_emulated_kernels(torch::Library& m)
#define HETCOMM_CUDA_SETTINGS_REGISTRATION(m) void register_emulated_settings(torch::Library& m)
