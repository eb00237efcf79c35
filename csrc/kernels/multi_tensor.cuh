// The multi-tensor kernel: y = cast<D>(float(x) * scale) over every chunk of a
// launch's segment table, with the optional non-finite check and per-chunk sum of
// squares, and the kernel that adds those partial sums up in a fixed order.
// Includes no torch header (see numeric.cuh).
//
// Element-to-thread mapping: a chunk is cut into groups of kGroup consecutive
// elements (16 bytes of the narrower type); thread t handles groups t, t + kThreads,
// t + 2 kThreads, ... in that order, kItems groups per loop trip so that several loads
// are in flight. The mapping, and so every rounding of the sum of squares, depends
// only on kThreads, kChunk and the dtype pair: not on kItems, the grid size, the
// GPU model or the alignment of the data.
#pragma once

#include "kernels/find_segment.cuh"
#include "kernels/launch_args.h"
#include "kernels/numeric.cuh"
#include "kernels/shared_memory.cuh"

namespace hetcomm::kernels {

// Elements per group: 16 bytes of the narrower type, so that every access of an
// aligned group is one or two 16-byte vector instructions.
template <typename S, typename D>
__host__ __device__ constexpr int group_width() {
  return 16 / (sizeof(typename S::Storage) < sizeof(typename D::Storage) ? sizeof(typename S::Storage)
                                                                          : sizeof(typename D::Storage));
}

// Moves a group as 16-byte words; both sides are 16-byte aligned (the local arrays
// are declared alignas(16)).
template <typename V, int kCount>
__device__ __forceinline__ void copy_words(const V* from, V* to) {
  static_assert(kCount * sizeof(V) % 16 == 0, "a group is a whole number of 16-byte words");
#pragma unroll
  for (int w = 0; w < static_cast<int>(kCount * sizeof(V) / 16); ++w) {
    reinterpret_cast<uint4*>(to)[w] = reinterpret_cast<const uint4*>(from)[w];
  }
}

// Group g of a chunk of n elements, widened to fp32. Elements past n read as 0, which
// changes neither the check nor the sum of squares.
template <typename T, int kGroup, bool kAligned>
__device__ __forceinline__ void load_group(const typename T::Storage* chunk, int g, int n, float (&out)[kGroup]) {
  using V = typename T::Storage;
  const V* p = chunk + g * kGroup;
  const int valid = n - g * kGroup;
  if (kAligned && valid >= kGroup) {
    alignas(16) V raw[kGroup];
    copy_words<V, kGroup>(p, raw);
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      out[j] = T::load(raw[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      out[j] = j < valid ? T::load(p[j]) : 0.0f;
    }
  }
}

// Rounds `values` to T, stores the elements of group g that lie inside the chunk, and
// leaves in `values` what was stored (widened back), for the check and the sum.
template <typename T, int kGroup, bool kAligned>
__device__ __forceinline__ void store_group(float (&values)[kGroup], typename T::Storage* chunk, int g, int n) {
  using V = typename T::Storage;
  alignas(16) V raw[kGroup];
#pragma unroll
  for (int j = 0; j < kGroup; ++j) {
    raw[j] = T::store(values[j]);
    values[j] = T::load(raw[j]);
  }
  V* p = chunk + g * kGroup;
  const int valid = n - g * kGroup;
  if (kAligned && valid >= kGroup) {
    copy_words<V, kGroup>(raw, p);
  } else {
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      if (j < valid) {
        p[j] = raw[j];
      }
    }
  }
}

// One chunk of n elements. kAligned: both chunk pointers are 16-byte aligned, so full
// groups move as vectors; otherwise every element moves on its own (same mapping).
template <typename S, typename D, Work kWork, int kItems, bool kAligned>
__device__ __forceinline__ void run_chunk(const typename S::Storage* src, typename D::Storage* dst, int n,
                                          float scale, bool& nonfinite, double& sum_sq) {
  constexpr int kGroup = group_width<S, D>();
  const int groups = (n + kGroup - 1) / kGroup;
  for (int first = threadIdx.x; first < groups; first += kThreads * kItems) {
    float x[kItems][kGroup];
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int g = first + i * kThreads;
      if (g < groups) {
        load_group<S, kGroup, kAligned>(src, g, n, x[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int g = first + i * kThreads;
      if (g >= groups) {
        break;
      }
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        if constexpr (kWork == Work::kScaleCastCheckInput) {
          nonfinite |= is_nonfinite(x[i][j]);
        }
        x[i][j] *= scale;
      }
      store_group<D, kGroup, kAligned>(x[i], dst, g, n);
      if constexpr (kWork == Work::kScaleCastCheckOutput || kWork == Work::kScaleCastCheckOutputSumSq) {
#pragma unroll
        for (int j = 0; j < kGroup; ++j) {
          nonfinite |= is_nonfinite(x[i][j]);
        }
      }
      if constexpr (kWork == Work::kScaleCastCheckOutputSumSq) {
        // At most 8 squares in fp32 (relative error below 1e-6), then double, so
        // that a chunk's sum stays as accurate as the CPU back end's.
        float group_sum = 0.0f;
#pragma unroll
        for (int j = 0; j < kGroup; ++j) {
          group_sum = fmaf(x[i][j], x[i][j], group_sum);
        }
        sum_sq += static_cast<double>(group_sum);
      }
    }
  }
}

// The sum of v over the block, in a fixed order: a shuffle tree within each warp,
// then warp 0's lane sums in warp order. Valid in thread 0; every thread must call it.
__device__ __forceinline__ double block_sum(double v, double (&warp_sums)[kWarps]) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    v += __shfl_down_sync(0xFFFFFFFFu, v, offset);
  }
  if (threadIdx.x % 32 == 0) {
    warp_sums[threadIdx.x / 32] = v;
  }
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      total += warp_sums[w];
    }
  }
  __syncthreads();  // warp_sums is reused by the caller's next round
  return total;
}

// Table: SegmentTable (in the arguments) or DeviceSegmentTable (in device memory).
template <typename S, typename D, Work kWork, int kItems, typename Table = SegmentTable>
__global__ void __launch_bounds__(kThreads) multi_tensor_kernel(const MultiTensorArgs<Table> args) {
  using SV = typename S::Storage;
  using DV = typename D::Storage;
  HETCOMM_SHARED(double, warp_sums, [kWarps]);

  const float scale = args.scale == nullptr ? 1.0f : *args.scale;
  bool nonfinite = false;
  for (int c = blockIdx.x; c < args.table.num_chunks; c += gridDim.x) {
    const int k = find_segment(args.table, c);
    const int begin = (c - args.table.first_chunk[k]) * kChunk;
    const int n = min(kChunk, args.table.numel[k] - begin);
    const SV* src = static_cast<const SV*>(args.table.src[k]) + begin;
    DV* dst = static_cast<DV*>(args.table.dst[k]) + begin;
    const bool aligned = ((reinterpret_cast<unsigned long long>(src) | reinterpret_cast<unsigned long long>(dst)) %
                          16) == 0;
    double sum_sq = 0.0;
    if (aligned) {
      run_chunk<S, D, kWork, kItems, true>(src, dst, n, scale, nonfinite, sum_sq);
    } else {
      run_chunk<S, D, kWork, kItems, false>(src, dst, n, scale, nonfinite, sum_sq);
    }
    if constexpr (kWork == Work::kScaleCastCheckOutputSumSq) {
      const double chunk_sum = block_sum(sum_sq, warp_sums);
      if (threadIdx.x == 0) {
        args.partials[args.partial_base + c] = chunk_sum;
      }
    }
  }
  // Every writer stores the same 1, so the race is benign and needs no atomic;
  // found_inf is never cleared here (the caller zeroes it once per step).
  if (kWork != Work::kScaleCast && nonfinite) {
    *args.found_inf = 1.0f;
  }
}

// sq_norm += float(sum of partials[0..count)), summed in a fixed order by one block,
// so that identical inputs give identical bits on every run and every rank.
__global__ void __launch_bounds__(kThreads) add_sum_of_squares_kernel(const double* partials, long long count,
                                                                      float* sq_norm) {
  HETCOMM_SHARED(double, warp_sums, [kWarps]);
  double sum = 0.0;
  for (long long i = threadIdx.x; i < count; i += kThreads) {
    sum += partials[i];
  }
  const double total = block_sum(sum, warp_sums);
  if (threadIdx.x == 0) {
    *sq_norm += static_cast<float>(total);
  }
}

}  // namespace hetcomm::kernels
