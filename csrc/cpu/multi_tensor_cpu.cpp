#include "cpu/multi_tensor_cpu.h"

#include "cpu/chunks.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <string>

namespace hetcomm::cpu {
namespace {

bool cpu_has_avx2_f16c() {
#if HETCOMM_HAS_AVX2_PATH
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

}  // namespace

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

namespace {

using SpanFn = void (*)(const void* src, void* dst, int64_t n, float scale, SpanStats& stats);

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

  std::vector<SpanStats> partial((total + kChunk - 1) / kChunk);
  for_each_piece(offsets, [&](int64_t chunk, size_t k, int64_t local, int64_t n) {
    const Segment& seg = segments[k];
    spans[k](static_cast<const char*>(seg.src) + local * c10::elementSize(seg.src_type),
             static_cast<char*>(seg.dst) + local * c10::elementSize(seg.dst_type), n, scale, partial[chunk]);
  });

  SpanStats result;
  for (const SpanStats& p : partial) {
    result.nonfinite |= p.nonfinite;
    result.sum_sq += p.sum_sq;
  }
  return result;
}

}  // namespace hetcomm::cpu
