// Argument validation shared by every back end. Each check names the op and the
// argument and says what was expected; all of an op's checks run before it writes
// anything, so a rejected call leaves every tensor as it was.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace hetcomm {

// "torch.float32" style names, as Python users write them.
std::string dtype_name(c10::ScalarType type);

bool is_supported_float(c10::ScalarType type);

// A tensor of a list: defined, float32/float16/bfloat16, contiguous, on `device`.
void check_float_tensor(const char* op, const std::string& name, const at::Tensor& t,
                        const c10::Device& device);

// The device of a list's first tensor; fails on an empty list or undefined tensor.
c10::Device list_device(const char* op, const char* name, at::TensorList list);

// A non-empty list whose every element passes check_float_tensor.
void check_float_list(const char* op, const char* name, at::TensorList list, const c10::Device& device);

// A one-element float32 tensor on `device`: scales, found_inf, sq_norm.
void check_scalar_tensor(const char* op, const char* name, const at::Tensor& t, const c10::Device& device);

void check_supported_dtype(const char* op, const char* name, c10::ScalarType type);

// One tensor's memory, for the aliasing check.
struct Region {
  std::string name;
  const at::Tensor* tensor;
  bool written;
};

// Fails if a written tensor shares memory with any other tensor of the call:
// the result would depend on the order in which elements are visited.
void check_no_overlap(const char* op, const std::vector<Region>& regions);

// Appends list[i] as "name[i]" regions.
void add_regions(std::vector<Region>& regions, const char* name, at::TensorList list, bool written);

}  // namespace hetcomm
