#include "cuda/adamw_cuda.h"

#include "cuda/device_tables.h"
#include "cuda/hooks.h"
#include "cuda/max_grid.h"
#include "kernels/adamw.cuh"

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <climits>
#include <map>
#include <utility>
#include <vector>

namespace hetcomm::cuda {
namespace {

using kernels::AdamWTable;
using kernels::DeviceAdamWTable;
using kernels::kChunk;
using kernels::kMaxAdamWSegments;
using kernels::kMaxSegmentNumel;
using kernels::kThreads;
template <typename Table>
using Kernel = void (*)(kernels::AdamWKernelArgs<Table>);

// In a device table's key: not a kernels::Work, which the multi-tensor tables use.
constexpr int kAdamWOp = 100;

template <typename Table, typename G>
Kernel<Table> with_copy(c10::ScalarType copy) {
  switch (copy) {
    case c10::ScalarType::Undefined:
      return &kernels::adamw_kernel<G, kernels::F32, false, Table>;
    case c10::ScalarType::Float:
      return &kernels::adamw_kernel<G, kernels::F32, true, Table>;
    case c10::ScalarType::Half:
      return &kernels::adamw_kernel<G, kernels::F16, true, Table>;
    case c10::ScalarType::BFloat16:
      return &kernels::adamw_kernel<G, kernels::BF16, true, Table>;
    default:
      TORCH_CHECK(false, "hetcomm.adamw_: unsupported copy dtype ", copy);
  }
}

template <typename Table>
Kernel<Table> select_kernel(c10::ScalarType grad, c10::ScalarType copy) {
  switch (grad) {
    case c10::ScalarType::Float:
      return with_copy<Table, kernels::F32>(copy);
    case c10::ScalarType::Half:
      return with_copy<Table, kernels::F16>(copy);
    case c10::ScalarType::BFloat16:
      return with_copy<Table, kernels::BF16>(copy);
    default:
      TORCH_CHECK(false, "hetcomm.adamw_: unsupported gradient dtype ", grad);
  }
}

// A table row: a parameter, or a kMaxSegmentNumel piece of a longer one.
struct Row {
  const void* grad;
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  void* copy;
  int numel;
};

// The rows of one (gradient, copy) dtype pair: rows [first_row, first_row + count).
struct Group {
  c10::ScalarType grad_type;
  c10::ScalarType copy_type;
  int64_t first_row;
  int64_t count;
  int64_t num_chunks;
};

struct Rows {
  std::vector<Row> rows;
  std::vector<Group> groups;
};

int chunks_of(int64_t numel) {
  return static_cast<int>((numel + kChunk - 1) / kChunk);
}

Rows rows_of(const AdamWSegmentList& segments) {
  std::map<std::pair<c10::ScalarType, c10::ScalarType>, std::vector<const AdamWSegment*>> by_pair;
  for (const AdamWSegment& segment : segments) {
    if (segment.numel > 0) {
      by_pair[{segment.grad_type, segment.copy_type}].push_back(&segment);
    }
  }
  Rows out;
  for (const auto& [types, members] : by_pair) {
    Group group{types.first, types.second, static_cast<int64_t>(out.rows.size()), 0, 0};
    for (const AdamWSegment* segment : members) {
      const int64_t grad_item = static_cast<int64_t>(c10::elementSize(segment->grad_type));
      const int64_t copy_item =
          segment->copy == nullptr ? 0 : static_cast<int64_t>(c10::elementSize(segment->copy_type));
      // Tensors longer than kMaxSegmentNumel go in pieces, so that counts fit in 32 bits.
      for (int64_t done = 0; done < segment->numel; done += kMaxSegmentNumel) {
        const int64_t piece = std::min<int64_t>(kMaxSegmentNumel, segment->numel - done);
        out.rows.push_back({static_cast<const char*>(segment->grad) + done * grad_item, segment->param + done,
                            segment->exp_avg + done, segment->exp_avg_sq + done,
                            segment->copy == nullptr ? nullptr : static_cast<char*>(segment->copy) + done * copy_item,
                            static_cast<int>(piece)});
        group.num_chunks += chunks_of(piece);
      }
    }
    group.count = static_cast<int64_t>(out.rows.size()) - group.first_row;
    out.groups.push_back(group);
  }
  return out;
}

constexpr int kPointerColumns = 5;  // grad, param, exp_avg, exp_avg_sq, copy

// The device table of all rows: the five pointer columns, then first_chunk (within the
// row's group) and numel as 32-bit ints, two to a word.
std::vector<int64_t> table_words(const Rows& rows) {
  const size_t n = rows.rows.size();
  std::vector<int64_t> words((kPointerColumns + 1) * n);
  int* ints = reinterpret_cast<int*>(words.data() + kPointerColumns * n);
  const auto word = [](const void* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); };
  for (const Group& group : rows.groups) {
    TORCH_CHECK(group.num_chunks <= INT_MAX, "hetcomm.adamw_: more than ", INT_MAX, " chunks of ", kChunk,
                " elements of one dtype pair");
    int first_chunk = 0;
    for (int64_t r = group.first_row; r < group.first_row + group.count; ++r) {
      const Row& row = rows.rows[r];
      words[r] = word(row.grad);
      words[n + r] = word(row.param);
      words[2 * n + r] = word(row.exp_avg);
      words[3 * n + r] = word(row.exp_avg_sq);
      words[4 * n + r] = word(row.copy);
      ints[r] = first_chunk;
      ints[n + r] = row.numel;
      first_chunk += chunks_of(row.numel);
    }
  }
  return words;
}

std::vector<int64_t> group_words(const Rows& rows) {
  std::vector<int64_t> words;
  for (const Group& group : rows.groups) {
    words.insert(words.end(), {static_cast<int64_t>(group.grad_type), static_cast<int64_t>(group.copy_type),
                               group.first_row, group.count});
  }
  return words;
}

// The walk of one call: the launches of every group, in order, on one stream.
class Walk {
 public:
  // args: the scalars and hyper-parameters of every launch; its table is filled here.
  Walk(const kernels::AdamWArgs& args, int device, cudaStream_t stream)
      : args_(args), device_(device), stream_(stream) {}

  // Up to kMaxAdamWSegments rows per launch, in the kernel's arguments.
  void from_arguments(const Rows& rows) {
    for (const Group& group : rows.groups) {
      const Kernel<AdamWTable> kernel = select_kernel<AdamWTable>(group.grad_type, group.copy_type);
      const int grid = max_grid(kernel, device_);
      kernels::AdamWArgs args = args_;
      AdamWTable& table = args.table;
      table.count = 0;
      table.num_chunks = 0;
      for (int64_t r = group.first_row; r < group.first_row + group.count; ++r) {
        if (table.count == kMaxAdamWSegments) {
          launch(kernel, args, grid);
        }
        const Row& row = rows.rows[r];
        const int at = table.count;
        table.grad[at] = row.grad;
        table.param[at] = row.param;
        table.exp_avg[at] = row.exp_avg;
        table.exp_avg_sq[at] = row.exp_avg_sq;
        table.copy[at] = row.copy;
        table.first_chunk[at] = table.num_chunks;
        table.numel[at] = row.numel;
        table.num_chunks += chunks_of(row.numel);
        ++table.count;
      }
      launch(kernel, args, grid);
    }
  }

  // One launch per group, reading `table` (words laid out by table_words).
  void from_device_table(const Rows& rows, const at::Tensor& table) {
    const int64_t n = static_cast<int64_t>(rows.rows.size());
    const int64_t* words = table.const_data_ptr<int64_t>();
    const int* ints = reinterpret_cast<const int*>(words + kPointerColumns * n);
    for (const Group& group : rows.groups) {
      const Kernel<DeviceAdamWTable> kernel = select_kernel<DeviceAdamWTable>(group.grad_type, group.copy_type);
      const int64_t r = group.first_row;
      kernels::DeviceAdamWArgs args{{reinterpret_cast<const void* const*>(words) + r,
                                     reinterpret_cast<float* const*>(words + n) + r,
                                     reinterpret_cast<float* const*>(words + 2 * n) + r,
                                     reinterpret_cast<float* const*>(words + 3 * n) + r,
                                     reinterpret_cast<void* const*>(words + 4 * n) + r, ints + r, ints + n + r,
                                     static_cast<int>(group.count), static_cast<int>(group.num_chunks)},
                                    args_.grad_scale, args_.found_inf, args_.step, args_.hyper};
      launch(kernel, args, max_grid(kernel, device_));
    }
  }

  int64_t launches() const { return launches_; }

 private:
  template <typename Table>
  void launch(Kernel<Table> kernel, kernels::AdamWKernelArgs<Table>& args, int max_grid) {
    if (args.table.count == 0) {
      return;
    }
    HETCOMM_LAUNCH(kernel, std::min(args.table.num_chunks, max_grid), kThreads, 0, stream_)(args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    ++launches_;
    args.table.count = 0;
    args.table.num_chunks = 0;
  }

  kernels::AdamWArgs args_;
  int device_;
  cudaStream_t stream_;
  int64_t launches_ = 0;
};

// A device table pays off where some dtype pair needs more than one launch's arguments.
bool needs_table(const Rows& rows) {
  return std::any_of(rows.groups.begin(), rows.groups.end(),
                     [](const Group& group) { return group.count > kMaxAdamWSegments; });
}

}  // namespace

void run_adamw(const AdamWSegmentList& segments, const AdamWHyper& hyper, const float* grad_scale,
               const float* found_inf, const float* step, const c10::Device& device, cudaStream_t stream) {
  const Rows rows = rows_of(segments);
  kernels::AdamWArgs args{};
  args.grad_scale = grad_scale;
  args.found_inf = found_inf;
  args.step = step;
  args.hyper = hyper;
  Walk walk(args, device.index(), stream);
  at::Tensor table;
  if (needs_table(rows) && !capturing(stream)) {
    table = find_device_table({kAdamWOp, device, stream, group_words(rows), table_words(rows)});
  }
  if (table.defined()) {
    walk.from_device_table(rows, table);
  } else {
    walk.from_arguments(rows);
  }
  record_launches(walk.launches());
}

}  // namespace hetcomm::cuda
