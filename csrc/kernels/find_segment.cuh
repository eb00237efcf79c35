// Which table entry holds a launch's chunk c, for the multi-tensor and adamw_ kernels.
// Includes nothing (see numeric.cuh).
#pragma once

namespace hetcomm::kernels {

// The segment holding chunk c: the last one whose first chunk is at or before c.
// Any table with first_chunk[] and count (SegmentTable, AdamWTable).
template <typename Table>
__device__ __forceinline__ int find_segment(const Table& table, int c) {
  int lo = 0;
  int hi = table.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table.first_chunk[mid] <= c) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace hetcomm::kernels
