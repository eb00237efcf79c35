#include "cuda/multi_tensor_cuda.h"

#include "cuda/hooks.h"
#include "cuda/launch_shape.h"
#include "cuda/max_grid.h"
#include "kernels/multi_tensor.cuh"

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <type_traits>
#include <utility>
#include <vector>

namespace hetcomm::cuda {
namespace {

using kernels::kChunk;
using kernels::kMaxSegmentNumel;
using kernels::kMaxSegments;
using kernels::kThreads;
using kernels::LaunchArgs;
using Kernel = void (*)(LaunchArgs);

template <typename S, typename D, Work kWork>
Kernel with_items(int items) {
  return items == 4 ? &kernels::multi_tensor_kernel<S, D, kWork, 4> : &kernels::multi_tensor_kernel<S, D, kWork, 2>;
}

template <typename S, typename D>
Kernel with_work(Work work, int items) {
  switch (work) {
    case Work::kScaleCast:
      return with_items<S, D, Work::kScaleCast>(items);
    case Work::kScaleCastCheckInput:
      // unscale_ works in place, so its source and destination types are one type.
      if constexpr (std::is_same_v<S, D>) {
        return with_items<S, D, Work::kScaleCastCheckInput>(items);
      }
      break;
    case Work::kScaleCastCheckOutput:
      return with_items<S, D, Work::kScaleCastCheckOutput>(items);
    case Work::kScaleCastCheckOutputSumSq:
      return with_items<S, D, Work::kScaleCastCheckOutputSumSq>(items);
  }
  TORCH_CHECK(false, "hetcomm: no CUDA kernel for work ", static_cast<int>(work), " on this dtype pair");
}

template <typename S>
Kernel with_dst(c10::ScalarType dst, Work work, int items) {
  switch (dst) {
    case c10::ScalarType::Float:
      return with_work<S, kernels::F32>(work, items);
    case c10::ScalarType::Half:
      return with_work<S, kernels::F16>(work, items);
    case c10::ScalarType::BFloat16:
      return with_work<S, kernels::BF16>(work, items);
    default:
      TORCH_CHECK(false, "hetcomm: unsupported destination dtype ", dst);
  }
}

Kernel select_kernel(c10::ScalarType src, c10::ScalarType dst, Work work, int items) {
  switch (src) {
    case c10::ScalarType::Float:
      return with_dst<kernels::F32>(dst, work, items);
    case c10::ScalarType::Half:
      return with_dst<kernels::F16>(dst, work, items);
    case c10::ScalarType::BFloat16:
      return with_dst<kernels::BF16>(dst, work, items);
    default:
      TORCH_CHECK(false, "hetcomm: unsupported source dtype ", src);
  }
}

// Fills argument tables with the segments of one dtype pair and launches each table
// when it is full, and the last one at finish().
class Launcher {
 public:
  Launcher(Kernel kernel, int max_grid, cudaStream_t stream, const LaunchArgs& args)
      : kernel_(kernel), max_grid_(max_grid), stream_(stream), args_(args) {}

  void add(const Segment& segment) {
    const int64_t src_item = static_cast<int64_t>(c10::elementSize(segment.src_type));
    const int64_t dst_item = static_cast<int64_t>(c10::elementSize(segment.dst_type));
    for (int64_t done = 0; done < segment.numel; done += kMaxSegmentNumel) {
      if (args_.table.count == kMaxSegments) {
        launch();
      }
      const int64_t piece = std::min<int64_t>(kMaxSegmentNumel, segment.numel - done);
      kernels::SegmentTable& table = args_.table;
      table.src[table.count] = static_cast<const char*>(segment.src) + done * src_item;
      table.dst[table.count] = static_cast<char*>(segment.dst) + done * dst_item;
      table.first_chunk[table.count] = table.num_chunks;
      table.numel[table.count] = static_cast<int>(piece);
      table.num_chunks += static_cast<int>((piece + kChunk - 1) / kChunk);
      ++table.count;
    }
  }

  // Launches what is left; returns the partial index after this pair's last chunk.
  int64_t finish() {
    launch();
    return args_.partial_base;
  }

 private:
  void launch() {
    kernels::SegmentTable& table = args_.table;
    if (table.count == 0) {
      return;
    }
    const int grid = std::min(table.num_chunks, max_grid_);
    HETCOMM_LAUNCH(kernel_, grid, kThreads, 0, stream_)(args_);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    args_.partial_base += table.num_chunks;
    table.count = 0;
    table.num_chunks = 0;
  }

  Kernel kernel_;
  int max_grid_;
  cudaStream_t stream_;
  LaunchArgs args_;
};

}  // namespace

int64_t count_chunks(const SegmentList& segments) {
  int64_t chunks = 0;
  for (const Segment& segment : segments) {
    chunks += (segment.numel + kChunk - 1) / kChunk;  // pieces split at multiples of kChunk
  }
  return chunks;
}

void run_segments(const SegmentList& segments, const float* scale, Work work, float* found_inf, double* partials,
                  int device, cudaStream_t stream) {
  // Grouped by dtype pair in a fixed order, and in list order within a pair, so the
  // partial sums of squares always come in the same order.
  std::map<std::pair<c10::ScalarType, c10::ScalarType>, std::vector<const Segment*>> groups;
  for (const Segment& segment : segments) {
    if (segment.numel > 0) {
      groups[{segment.src_type, segment.dst_type}].push_back(&segment);
    }
  }
  const DeviceLaunch launch = device_launch(device);
  LaunchArgs args{};
  args.scale = scale;
  args.found_inf = found_inf;
  args.partials = partials;
  for (const auto& [types, members] : groups) {
    const Kernel kernel = select_kernel(types.first, types.second, work, launch.shape.items_per_thread);
    Launcher launcher(kernel, max_grid(kernel, device), stream, args);
    for (const Segment* segment : members) {
      launcher.add(*segment);
    }
    args.partial_base = launcher.finish();
  }
}

void add_sum_of_squares(const double* partials, int64_t count, float* sq_norm, cudaStream_t stream) {
  HETCOMM_LAUNCH(kernels::add_sum_of_squares_kernel, 1, kThreads, 0, stream)(partials, count, sq_norm);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace hetcomm::cuda
