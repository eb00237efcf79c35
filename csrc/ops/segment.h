// A list-of-tensors op, seen as one flat index space cut into segments: segment k
// reads numel elements at src and writes them at dst. Device-agnostic: the CPU and
// CUDA back ends both execute the same segment list.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace hetcomm {

struct Segment {
  const void* src;
  void* dst;
  int64_t numel;
  c10::ScalarType src_type;
  c10::ScalarType dst_type;
};

using SegmentList = std::vector<Segment>;

}  // namespace hetcomm
