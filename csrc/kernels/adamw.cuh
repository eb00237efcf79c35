// adamw_'s CUDA kernel: per element one pass from the gradient (times grad_scale)
// through the fp32 master and both moments to the master's rounded copy, in the
// fp32 operations and order of the CPU kernel and hetcomm.reference.adamw_, each
// written as a round-to-nearest intrinsic so that nvcc contracts nothing into an FMA:
// the same bits on every back end. Includes no torch header (see numeric.cuh).
//
// A launch covers the parameters of one (gradient, copy) dtype pair, up to
// kMaxAdamWSegments of them in its arguments (AdamWTable) or any number in device
// memory (DeviceAdamWTable, for a list that recurs), cut into chunks of kChunk elements
// as the multi-tensor kernel's are; blocks stride over the chunks, and thread t takes
// elements t, t + kThreads, ... of a chunk.
#pragma once

#include "kernels/adamw_math.h"
#include "kernels/find_segment.cuh"
#include "kernels/launch_args.h"
#include "kernels/numeric.cuh"

namespace hetcomm::kernels {

// 5 pointers and 2 ints per parameter: 80 of them fill 3840 of the 4 KB of arguments.
constexpr int kMaxAdamWSegments = 80;

struct AdamWTable {
  const void* grad[kMaxAdamWSegments];
  float* param[kMaxAdamWSegments];
  float* exp_avg[kMaxAdamWSegments];
  float* exp_avg_sq[kMaxAdamWSegments];
  void* copy[kMaxAdamWSegments];  // null in a launch without copies
  int first_chunk[kMaxAdamWSegments];
  int numel[kMaxAdamWSegments];
  int count;
  int num_chunks;
};

// The same columns in device memory, read through these pointers: no limit on count.
struct DeviceAdamWTable {
  const void* const* grad;
  float* const* param;
  float* const* exp_avg;
  float* const* exp_avg_sq;
  void* const* copy;
  const int* first_chunk;
  const int* numel;
  int count;
  int num_chunks;
};

template <typename Table>
struct AdamWKernelArgs {
  Table table;
  const float* grad_scale;  // device scalars: nothing is read on the host
  const float* found_inf;
  const float* step;
  AdamWHyper hyper;
};

using AdamWArgs = AdamWKernelArgs<AdamWTable>;
using DeviceAdamWArgs = AdamWKernelArgs<DeviceAdamWTable>;

static_assert(sizeof(AdamWArgs) <= 4096, "kernel arguments must fit CUDA 12's 4 KB limit");

// Table: AdamWTable (in the arguments) or DeviceAdamWTable (in device memory).
template <typename G, typename C, bool kCopy, typename Table = AdamWTable>
__global__ void __launch_bounds__(kThreads) adamw_kernel(const AdamWKernelArgs<Table> args) {
  if (*args.found_inf != 0.0f) {
    return;  // an overflow somewhere: the step is skipped, nothing changes
  }
  const AdamWConstants k = adamw_constants(args.hyper, *args.step);
  const float scale = *args.grad_scale;
  for (int c = blockIdx.x; c < args.table.num_chunks; c += gridDim.x) {
    const int s = find_segment(args.table, c);
    const int begin = (c - args.table.first_chunk[s]) * kChunk;
    const int n = min(kChunk, args.table.numel[s] - begin);
    const typename G::Storage* grad = static_cast<const typename G::Storage*>(args.table.grad[s]) + begin;
    float* param = args.table.param[s] + begin;
    float* exp_avg = args.table.exp_avg[s] + begin;
    float* exp_avg_sq = args.table.exp_avg_sq[s] + begin;
    typename C::Storage* copy = kCopy ? static_cast<typename C::Storage*>(args.table.copy[s]) + begin : nullptr;
    for (int i = threadIdx.x; i < n; i += kThreads) {
      const float g = __fmul_rn(G::load(grad[i]), scale);
      const float m = exp_avg[i];
      const float avg = __fadd_rn(m, __fmul_rn(__fsub_rn(g, m), k.beta1_weight));
      const float sq = __fadd_rn(__fmul_rn(exp_avg_sq[i], k.beta2), __fmul_rn(__fmul_rn(g, g), k.beta2_weight));
      const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(sq), k.bias_correction2_sqrt), k.eps);
      const float p = __fadd_rn(__fmul_rn(param[i], k.decay), __fmul_rn(__fdiv_rn(avg, denom), k.neg_step_size));
      exp_avg[i] = avg;
      exp_avg_sq[i] = sq;
      param[i] = p;
      if constexpr (kCopy) {
        copy[i] = C::store(p);
      }
    }
  }
}

}  // namespace hetcomm::kernels
