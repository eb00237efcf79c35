#include "cuda/adamw_cuda.h"

#include "cuda/hooks.h"
#include "cuda/max_grid.h"
#include "kernels/adamw.cuh"

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

namespace hetcomm::cuda {
namespace {

using kernels::AdamWArgs;
using kernels::kChunk;
using kernels::kMaxAdamWSegments;
using kernels::kMaxSegmentNumel;
using kernels::kThreads;
using Kernel = void (*)(AdamWArgs);

template <typename G>
Kernel with_copy(c10::ScalarType copy) {
  switch (copy) {
    case c10::ScalarType::Undefined:
      return &kernels::adamw_kernel<G, kernels::F32, false>;
    case c10::ScalarType::Float:
      return &kernels::adamw_kernel<G, kernels::F32, true>;
    case c10::ScalarType::Half:
      return &kernels::adamw_kernel<G, kernels::F16, true>;
    case c10::ScalarType::BFloat16:
      return &kernels::adamw_kernel<G, kernels::BF16, true>;
    default:
      TORCH_CHECK(false, "hetcomm.adamw_: unsupported copy dtype ", copy);
  }
}

Kernel select_kernel(c10::ScalarType grad, c10::ScalarType copy) {
  switch (grad) {
    case c10::ScalarType::Float:
      return with_copy<kernels::F32>(copy);
    case c10::ScalarType::Half:
      return with_copy<kernels::F16>(copy);
    case c10::ScalarType::BFloat16:
      return with_copy<kernels::BF16>(copy);
    default:
      TORCH_CHECK(false, "hetcomm.adamw_: unsupported gradient dtype ", grad);
  }
}

void launch(Kernel kernel, AdamWArgs& args, int max_grid, cudaStream_t stream) {
  if (args.table.count == 0) {
    return;
  }
  HETCOMM_LAUNCH(kernel, std::min(args.table.num_chunks, max_grid), kThreads, 0, stream)(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  args.table.count = 0;
  args.table.num_chunks = 0;
}

}  // namespace

void run_adamw(const AdamWSegmentList& segments, const AdamWHyper& hyper, const float* grad_scale,
               const float* found_inf, const float* step, int device, cudaStream_t stream) {
  std::map<std::pair<c10::ScalarType, c10::ScalarType>, std::vector<const AdamWSegment*>> groups;
  for (const AdamWSegment& segment : segments) {
    if (segment.numel > 0) {
      groups[{segment.grad_type, segment.copy_type}].push_back(&segment);
    }
  }
  AdamWArgs args{};
  args.grad_scale = grad_scale;
  args.found_inf = found_inf;
  args.step = step;
  args.hyper = hyper;
  for (const auto& [types, members] : groups) {
    const Kernel kernel = select_kernel(types.first, types.second);
    const int grid = max_grid(kernel, device);
    for (const AdamWSegment* segment : members) {
      const int64_t grad_item = static_cast<int64_t>(c10::elementSize(segment->grad_type));
      const int64_t copy_item =
          segment->copy == nullptr ? 0 : static_cast<int64_t>(c10::elementSize(segment->copy_type));
      // Tensors longer than kMaxSegmentNumel go in pieces, so that counts fit in 32 bits.
      for (int64_t done = 0; done < segment->numel; done += kMaxSegmentNumel) {
        if (args.table.count == kMaxAdamWSegments) {
          launch(kernel, args, grid, stream);
        }
        const int64_t piece = std::min<int64_t>(kMaxSegmentNumel, segment->numel - done);
        kernels::AdamWTable& table = args.table;
        const int at = table.count;
        table.grad[at] = static_cast<const char*>(segment->grad) + done * grad_item;
        table.param[at] = segment->param + done;
        table.exp_avg[at] = segment->exp_avg + done;
        table.exp_avg_sq[at] = segment->exp_avg_sq + done;
        table.copy[at] = segment->copy == nullptr ? nullptr : static_cast<char*>(segment->copy) + done * copy_item;
        table.first_chunk[at] = table.num_chunks;
        table.numel[at] = static_cast<int>(piece);
        table.num_chunks += static_cast<int>((piece + kChunk - 1) / kChunk);
        ++table.count;
      }
    }
    launch(kernel, args, grid, stream);
  }
}

}  // namespace hetcomm::cuda
