// What one launch of the multi-tensor kernel receives, shared by the kernels and the
// host launcher. Plain C++ with no header at all, so that NVRTC and the host compiler
// see the same layout.
//
// A launch covers the segments of one (source, destination) dtype pair: up to
// kMaxSegments of them in its arguments (SegmentTable), or any number in a table in
// device memory (DeviceSegmentTable, built once for a list that recurs: see
// cuda/device_tables.h). Each segment is cut into chunks of kChunk elements; chunk c of
// the launch is found by a binary search over first_chunk, so the table costs nothing
// per chunk and a launch can cover any amount of data. Blocks stride over the
// launch's chunks.
#pragma once

namespace hetcomm::kernels {

// Threads per block. Fixed (not tuned per device) because the sum of squares is
// reduced in a per-thread, then per-block order: keeping it fixed makes that sum
// the same on every GPU model of a heterogeneous cluster.
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Elements per chunk, the unit of work of a block and of the sum-of-squares
// partials. Small enough that 1M elements still make 128 chunks for the SMs to
// share, large enough that the per-chunk bookkeeping (a binary search in the
// argument table, one block reduction) is noise next to 8192 loads and stores.
constexpr int kChunk = 8192;

// Segments per launch: the table below must fit the 4 KB of kernel arguments that
// CUDA 12 and older allow (CUDA 12.1+ on Volta+ allows more, but Pascal builds and
// older toolkits do not). 160 x 24 bytes = 3840 bytes; a list of 1,000 tensors of one
// dtype pair is 7 launches from arguments, and one from a device table once it recurs.
constexpr int kMaxSegments = 160;

// Longer tensors are split into several segments, so that element counts and chunk
// indices fit in 32 bits. A multiple of kChunk, so that every piece keeps the
// alignment of the tensor it comes from. The CPU emulator builds one GPU with far
// shorter segments (HETCOMM_MAX_SEGMENT_NUMEL), so that its tests take the split with
// tensors of thousands of elements rather than 2^30.
#ifndef HETCOMM_MAX_SEGMENT_NUMEL
#define HETCOMM_MAX_SEGMENT_NUMEL (1LL << 30)
#endif
constexpr long long kMaxSegmentNumel = HETCOMM_MAX_SEGMENT_NUMEL;
static_assert(kMaxSegmentNumel % kChunk == 0, "segment pieces must start on a chunk boundary");
static_assert(kMaxSegmentNumel <= (1LL << 30), "a segment's element counts and chunk indices fit in 32 bits");

enum class Work : int {
  kScaleCast,                  // pack, cast_ (scale 1)
  kScaleCastCheckInput,        // unscale_: GradScaler checks the values before scaling
  kScaleCastCheckOutput,       // unpack_ without a norm: checks what it wrote
  kScaleCastCheckOutputSumSq,  // unpack_ with a norm
};

struct SegmentTable {
  const void* src[kMaxSegments];
  void* dst[kMaxSegments];
  int first_chunk[kMaxSegments];  // index of the segment's first chunk within the launch
  int numel[kMaxSegments];
  int count;       // segments in use
  int num_chunks;  // chunks of all segments in use
};

// The same columns in device memory, read through these pointers: no limit on count.
struct DeviceSegmentTable {
  const void* const* src;
  void* const* dst;
  const int* first_chunk;
  const int* numel;
  int count;
  int num_chunks;
};

template <typename Table>
struct MultiTensorArgs {
  Table table;
  const float* scale;      // device scalar; null means 1 (cast_)
  float* found_inf;        // set to 1 on a non-finite value; null when nothing is checked
  double* partials;        // one sum of squares per chunk; null unless kScaleCastCheckOutputSumSq
  long long partial_base;  // index in partials of this launch's chunk 0
};

using LaunchArgs = MultiTensorArgs<SegmentTable>;
using DeviceTableArgs = MultiTensorArgs<DeviceSegmentTable>;

static_assert(sizeof(LaunchArgs) <= 4096, "kernel arguments must fit CUDA 12's 4 KB limit");

}  // namespace hetcomm::kernels
