#include "cpu/multi_tensor_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <string>

namespace hetcomm::cpu {
namespace {

// Elements per unit of parallel work: large enough that the per-chunk bookkeeping
// (a binary search, a function-pointer call per segment piece) is noise, small enough
// that 4M elements still give every core several chunks.
constexpr int64_t kChunk = 1 << 15;

using SpanFn = void (*)(const void* src, void* dst, int64_t n, float scale, SpanStats& stats);

bool cpu_has_avx2_f16c() {
#if HETCOMM_HAS_AVX2_PATH
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

// HETCOMM_CPU_ISA=scalar forces the portable loops (to test them, or to rule the
// vector path out when chasing a numerical difference); read once per process.
bool use_avx2() {
  static const bool use = [] {
    const char* requested = std::getenv("HETCOMM_CPU_ISA");
    const std::string isa = requested == nullptr ? "auto" : requested;
    TORCH_CHECK(isa == "auto" || isa == "scalar", "HETCOMM_CPU_ISA must be 'auto' or 'scalar'; got '", isa, "'");
    return isa == "auto" && cpu_has_avx2_f16c();
  }();
  return use;
}

template <typename S, typename D, Check kCheck, bool kSumSq>
void span_entry(const void* src, void* dst, int64_t n, float scale, SpanStats& stats) {
  const S* s = static_cast<const S*>(src);
  D* d = static_cast<D*>(dst);
#if HETCOMM_HAS_AVX2_PATH
  if (use_avx2()) {
    span_avx2<S, D, kCheck, kSumSq>(s, d, n, scale, stats);
    return;
  }
#endif
  span_scalar<S, D, kCheck, kSumSq>(s, d, n, scale, stats);
}

template <typename S, typename D>
SpanFn select_work(Work work) {
  switch (work) {
    case Work::kScaleCast:
      return &span_entry<S, D, Check::kNone, false>;
    case Work::kScaleCastCheckInput:
      return &span_entry<S, D, Check::kInput, false>;
    case Work::kScaleCastCheckOutput:
      return &span_entry<S, D, Check::kOutput, false>;
    case Work::kScaleCastCheckOutputSumSq:
      return &span_entry<S, D, Check::kOutput, true>;
  }
  TORCH_CHECK(false, "hetcomm: unknown work kind");
}

template <typename S>
SpanFn select_dst(c10::ScalarType dst, Work work) {
  switch (dst) {
    case c10::ScalarType::Float:
      return select_work<S, float>(work);
    case c10::ScalarType::Half:
      return select_work<S, c10::Half>(work);
    case c10::ScalarType::BFloat16:
      return select_work<S, c10::BFloat16>(work);
    default:
      TORCH_CHECK(false, "hetcomm: unsupported destination dtype ", dst);
  }
}

SpanFn select_span(c10::ScalarType src, c10::ScalarType dst, Work work) {
  switch (src) {
    case c10::ScalarType::Float:
      return select_dst<float>(dst, work);
    case c10::ScalarType::Half:
      return select_dst<c10::Half>(dst, work);
    case c10::ScalarType::BFloat16:
      return select_dst<c10::BFloat16>(dst, work);
    default:
      TORCH_CHECK(false, "hetcomm: unsupported source dtype ", src);
  }
}

}  // namespace

const char* vector_isa() {
  return use_avx2() ? "avx2+fma+f16c" : "scalar";
}

SpanStats run_segments(const SegmentList& segments, float scale, Work work) {
  const size_t count = segments.size();
  std::vector<int64_t> offsets(count + 1, 0);
  std::vector<SpanFn> spans(count);
  for (size_t k = 0; k < count; ++k) {
    offsets[k + 1] = offsets[k] + segments[k].numel;
    spans[k] = select_span(segments[k].src_type, segments[k].dst_type, work);
  }
  const int64_t total = offsets[count];
  if (total == 0) {
    return {};
  }

  const int64_t num_chunks = (total + kChunk - 1) / kChunk;
  std::vector<SpanStats> partial(num_chunks);
  at::parallel_for(0, num_chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
      const int64_t begin = chunk * kChunk;
      const int64_t end = std::min(total, begin + kChunk);
      // The segment holding `begin`: the last one starting at or before it.
      size_t k = std::upper_bound(offsets.begin(), offsets.begin() + count, begin) - offsets.begin() - 1;
      for (int64_t pos = begin; pos < end; ++k) {
        const int64_t stop = std::min(end, offsets[k + 1]);
        const int64_t local = pos - offsets[k];
        const Segment& seg = segments[k];
        const size_t src_item = c10::elementSize(seg.src_type);
        const size_t dst_item = c10::elementSize(seg.dst_type);
        spans[k](static_cast<const char*>(seg.src) + local * src_item,
                 static_cast<char*>(seg.dst) + local * dst_item, stop - pos, scale, partial[chunk]);
        pos = stop;
      }
    }
  });

  SpanStats result;
  for (const SpanStats& p : partial) {
    result.nonfinite |= p.nonfinite;
    result.sum_sq += p.sum_sq;
  }
  return result;
}

}  // namespace hetcomm::cpu
