// One parameter's work in adamw_, device-agnostic like ops/segment.h: the CPU and
// CUDA back ends both run the same list.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace hetcomm {

// Its gradient (any float dtype), its fp32 master and moments, and where its copy
// goes (copy == nullptr: no copy).
struct AdamWSegment {
  const void* grad;
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  void* copy;
  int64_t numel;
  c10::ScalarType grad_type;
  c10::ScalarType copy_type;
};

using AdamWSegmentList = std::vector<AdamWSegment>;

}  // namespace hetcomm
