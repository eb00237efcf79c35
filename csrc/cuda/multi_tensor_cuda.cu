#include "cuda/multi_tensor_cuda.h"

#include "cuda/device_tables.h"
#include "cuda/hooks.h"
#include "cuda/launch_shape.h"
#include "cuda/max_grid.h"
#include "kernels/multi_tensor.cuh"

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <climits>
#include <map>
#include <type_traits>
#include <utility>
#include <vector>

namespace hetcomm::cuda {
namespace {

using kernels::DeviceSegmentTable;
using kernels::kChunk;
using kernels::kMaxSegmentNumel;
using kernels::kMaxSegments;
using kernels::kThreads;
using kernels::SegmentTable;
template <typename Table>
using Kernel = void (*)(kernels::MultiTensorArgs<Table>);

template <typename Table, typename S, typename D, Work kWork>
Kernel<Table> with_items(int items) {
  return items == 4 ? &kernels::multi_tensor_kernel<S, D, kWork, 4, Table>
                    : &kernels::multi_tensor_kernel<S, D, kWork, 2, Table>;
}

template <typename Table, typename S, typename D>
Kernel<Table> with_work(Work work, int items) {
  switch (work) {
    case Work::kScaleCast:
      return with_items<Table, S, D, Work::kScaleCast>(items);
    case Work::kScaleCastCheckInput:
      // unscale_ works in place, so its source and destination types are one type.
      if constexpr (std::is_same_v<S, D>) {
        return with_items<Table, S, D, Work::kScaleCastCheckInput>(items);
      }
      break;
    case Work::kScaleCastCheckOutput:
      return with_items<Table, S, D, Work::kScaleCastCheckOutput>(items);
    case Work::kScaleCastCheckOutputSumSq:
      return with_items<Table, S, D, Work::kScaleCastCheckOutputSumSq>(items);
  }
  TORCH_CHECK(false, "hetcomm: no CUDA kernel for work ", static_cast<int>(work), " on this dtype pair");
}

template <typename Table, typename S>
Kernel<Table> with_dst(c10::ScalarType dst, Work work, int items) {
  switch (dst) {
    case c10::ScalarType::Float:
      return with_work<Table, S, kernels::F32>(work, items);
    case c10::ScalarType::Half:
      return with_work<Table, S, kernels::F16>(work, items);
    case c10::ScalarType::BFloat16:
      return with_work<Table, S, kernels::BF16>(work, items);
    default:
      TORCH_CHECK(false, "hetcomm: unsupported destination dtype ", dst);
  }
}

template <typename Table>
Kernel<Table> select_kernel(c10::ScalarType src, c10::ScalarType dst, Work work, int items) {
  switch (src) {
    case c10::ScalarType::Float:
      return with_dst<Table, kernels::F32>(dst, work, items);
    case c10::ScalarType::Half:
      return with_dst<Table, kernels::F16>(dst, work, items);
    case c10::ScalarType::BFloat16:
      return with_dst<Table, kernels::BF16>(dst, work, items);
    default:
      TORCH_CHECK(false, "hetcomm: unsupported source dtype ", src);
  }
}

// A table row: a segment, or a kMaxSegmentNumel piece of a longer one.
struct Row {
  const void* src;
  void* dst;
  int numel;
};

// The rows of one dtype pair: rows [first_row, first_row + count) of the call.
struct Group {
  c10::ScalarType src_type;
  c10::ScalarType dst_type;
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

// Grouped by dtype pair in a fixed order, and in list order within a pair, so the
// partial sums of squares always come in the same order.
Rows rows_of(const SegmentList& segments) {
  std::map<std::pair<c10::ScalarType, c10::ScalarType>, std::vector<const Segment*>> by_pair;
  for (const Segment& segment : segments) {
    if (segment.numel > 0) {
      by_pair[{segment.src_type, segment.dst_type}].push_back(&segment);
    }
  }
  Rows out;
  for (const auto& [types, members] : by_pair) {
    Group group{types.first, types.second, static_cast<int64_t>(out.rows.size()), 0, 0};
    for (const Segment* segment : members) {
      const int64_t src_item = static_cast<int64_t>(c10::elementSize(segment->src_type));
      const int64_t dst_item = static_cast<int64_t>(c10::elementSize(segment->dst_type));
      for (int64_t done = 0; done < segment->numel; done += kMaxSegmentNumel) {
        const int64_t piece = std::min<int64_t>(kMaxSegmentNumel, segment->numel - done);
        out.rows.push_back({static_cast<const char*>(segment->src) + done * src_item,
                            static_cast<char*>(segment->dst) + done * dst_item, static_cast<int>(piece)});
        group.num_chunks += chunks_of(piece);
      }
    }
    group.count = static_cast<int64_t>(out.rows.size()) - group.first_row;
    out.groups.push_back(group);
  }
  return out;
}

// The walk of one call: the launches of every group, in order, on one stream.
class Walk {
 public:
  // args: the scale, found_inf and partials of every launch; its table is filled here.
  Walk(const kernels::LaunchArgs& args, int device, cudaStream_t stream)
      : args_(args), device_(device), stream_(stream) {}

  // Up to kMaxSegments rows per launch, in the kernel's arguments.
  void from_arguments(const Rows& rows, Work work, int items) {
    for (const Group& group : rows.groups) {
      const Kernel<SegmentTable> kernel = select_kernel<SegmentTable>(group.src_type, group.dst_type, work, items);
      const int grid = max_grid(kernel, device_);
      kernels::LaunchArgs args = args_;
      SegmentTable& table = args.table;
      table.count = 0;
      table.num_chunks = 0;
      for (int64_t r = group.first_row; r < group.first_row + group.count; ++r) {
        if (table.count == kMaxSegments) {
          launch(kernel, args, grid);
        }
        const Row& row = rows.rows[r];
        table.src[table.count] = row.src;
        table.dst[table.count] = row.dst;
        table.first_chunk[table.count] = table.num_chunks;
        table.numel[table.count] = row.numel;
        table.num_chunks += chunks_of(row.numel);
        ++table.count;
      }
      launch(kernel, args, grid);
    }
  }

  // One launch per group, reading `table` (words laid out by table_words).
  void from_device_table(const Rows& rows, const at::Tensor& table, Work work, int items) {
    const int64_t n = static_cast<int64_t>(rows.rows.size());
    const int64_t* words = table.const_data_ptr<int64_t>();
    const int* ints = reinterpret_cast<const int*>(words + 2 * n);
    for (const Group& group : rows.groups) {
      const Kernel<DeviceSegmentTable> kernel =
          select_kernel<DeviceSegmentTable>(group.src_type, group.dst_type, work, items);
      kernels::DeviceTableArgs args{{reinterpret_cast<const void* const*>(words) + group.first_row,
                                     reinterpret_cast<void* const*>(words + n) + group.first_row,
                                     ints + group.first_row, ints + n + group.first_row,
                                     static_cast<int>(group.count), static_cast<int>(group.num_chunks)},
                                    args_.scale, args_.found_inf, args_.partials, 0};
      launch(kernel, args, max_grid(kernel, device_));
    }
  }

  int64_t launches() const { return launches_; }

 private:
  template <typename Table>
  void launch(Kernel<Table> kernel, kernels::MultiTensorArgs<Table>& args, int max_grid) {
    if (args.table.count == 0) {
      return;
    }
    // Each launch's partials follow the previous one's, in chunk order.
    args.partial_base = partial_base_;
    HETCOMM_LAUNCH(kernel, std::min(args.table.num_chunks, max_grid), kThreads, 0, stream_)(args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    ++launches_;
    partial_base_ += args.table.num_chunks;
    args.table.count = 0;
    args.table.num_chunks = 0;
  }

  kernels::LaunchArgs args_;
  int device_;
  cudaStream_t stream_;
  int64_t partial_base_ = 0;
  int64_t launches_ = 0;
};

// The device table of all rows: columns src and dst (pointers), then first_chunk
// (within the row's group) and numel as 32-bit ints, two to a word.
std::vector<int64_t> table_words(const Rows& rows) {
  const size_t n = rows.rows.size();
  std::vector<int64_t> words(3 * n);
  int* ints = reinterpret_cast<int*>(words.data() + 2 * n);
  for (const Group& group : rows.groups) {
    TORCH_CHECK(group.num_chunks <= INT_MAX, "hetcomm: a list of more than ", INT_MAX, " chunks of ", kChunk,
                " elements of one dtype pair");
    int first_chunk = 0;
    for (int64_t r = group.first_row; r < group.first_row + group.count; ++r) {
      const Row& row = rows.rows[r];
      words[r] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(row.src));
      words[n + r] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(row.dst));
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
    words.insert(words.end(), {static_cast<int64_t>(group.src_type), static_cast<int64_t>(group.dst_type),
                               group.first_row, group.count});
  }
  return words;
}

// A device table pays off where some dtype pair needs more than one launch's arguments.
bool needs_table(const Rows& rows) {
  return std::any_of(rows.groups.begin(), rows.groups.end(),
                     [](const Group& group) { return group.count > kMaxSegments; });
}

}  // namespace

int64_t count_chunks(const SegmentList& segments) {
  int64_t chunks = 0;
  for (const Segment& segment : segments) {
    chunks += (segment.numel + kChunk - 1) / kChunk;  // pieces split at multiples of kChunk
  }
  return chunks;
}

void run_segments(const SegmentList& segments, const float* scale, Work work, float* found_inf, double* partials,
                  const c10::Device& device, cudaStream_t stream) {
  const Rows rows = rows_of(segments);
  const int items = device_launch(device.index()).shape.items_per_thread;
  kernels::LaunchArgs args{};
  args.scale = scale;
  args.found_inf = found_inf;
  args.partials = partials;
  Walk walk(args, device.index(), stream);
  at::Tensor table;
  if (needs_table(rows) && !capturing(stream)) {
    table = find_device_table({static_cast<int>(work), device, stream, group_words(rows), table_words(rows)});
  }
  if (table.defined()) {
    walk.from_device_table(rows, table, work, items);
  } else {
    walk.from_arguments(rows, work, items);
  }
  record_launches(walk.launches());
}

void add_sum_of_squares(const double* partials, int64_t count, float* sq_norm, cudaStream_t stream) {
  HETCOMM_LAUNCH(kernels::add_sum_of_squares_kernel, 1, kThreads, 0, stream)(partials, count, sq_norm);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace hetcomm::cuda
