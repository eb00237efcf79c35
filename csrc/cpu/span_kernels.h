// Element loops over one contiguous span: y = cast<D>(float(x) * scale), with the
// optional non-finite check and sum of squares. One scalar version (tails, and CPUs
// without AVX2) and one AVX2+F16C version chosen at run time, so a wheel built on
// any x86-64 machine runs everywhere and still moves 8 elements per instruction
// where the CPU allows it.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HETCOMM_HAS_AVX2_PATH 1
#define HETCOMM_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define HETCOMM_HAS_AVX2_PATH 0
#endif

namespace hetcomm::cpu {

// Which values the finiteness check looks at. GradScaler's unscale checks its input;
// unpack checks what it wrote, which also catches an overflow of the destination dtype.
enum class Check { kNone, kInput, kOutput };

struct SpanStats {
  bool nonfinite = false;
  double sum_sq = 0.0;  // squares of fp32 values are exact in double; so is the sum, nearly
};

template <typename S, typename D, Check kCheck, bool kSumSq>
void span_scalar(const S* src, D* dst, int64_t n, float scale, SpanStats& stats) {
  bool nonfinite = false;
  double sum_sq = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const float x = static_cast<float>(src[i]);
    const D stored = static_cast<D>(x * scale);
    dst[i] = stored;
    if constexpr (kCheck == Check::kInput) {
      nonfinite |= !std::isfinite(x);
    }
    if constexpr (kCheck == Check::kOutput || kSumSq) {
      const float y = static_cast<float>(stored);
      if constexpr (kCheck == Check::kOutput) {
        nonfinite |= !std::isfinite(y);
      }
      if constexpr (kSumSq) {
        sum_sq += static_cast<double>(y) * y;
      }
    }
  }
  stats.nonfinite |= nonfinite;
  stats.sum_sq += sum_sq;
}

#if HETCOMM_HAS_AVX2_PATH

HETCOMM_TARGET_AVX2 inline __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}
HETCOMM_TARGET_AVX2 inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
HETCOMM_TARGET_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Each store returns the stored values widened back to fp32, so that the check and
// the sum of squares see exactly what landed in memory.
HETCOMM_TARGET_AVX2 inline __m256 store8(float* p, __m256 v) {
  _mm256_storeu_ps(p, v);
  return v;
}
HETCOMM_TARGET_AVX2 inline __m256 store8(c10::Half* p, __m256 v) {
  const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  return _mm256_cvtph_ps(h);
}
// Round-to-nearest-even on the bit pattern, NaN to 0x7FC0: the same bits as
// c10::BFloat16(float) and torch's .to(torch.bfloat16).
HETCOMM_TARGET_AVX2 inline __m256 store8(c10::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i biased = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
  __m256i rounded = _mm256_srli_epi32(biased, 16);
  const __m256 is_nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(is_nan));
  // packus interleaves 128-bit lanes; the permute puts elements 0..7 in the low half.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  return _mm256_castsi256_ps(_mm256_slli_epi32(rounded, 16));
}

// All-ones lanes where v is ±inf or NaN.
HETCOMM_TARGET_AVX2 inline __m256 nonfinite_mask(__m256 v) {
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
  return _mm256_cmp_ps(magnitude, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ);
}

template <typename S, typename D, Check kCheck, bool kSumSq>
HETCOMM_TARGET_AVX2 void span_avx2(const S* src, D* dst, int64_t n, float scale, SpanStats& stats) {
  const __m256 vscale = _mm256_set1_ps(scale);
  __m256 nonfinite = _mm256_setzero_ps();
  __m256d sum_lo = _mm256_setzero_pd();
  __m256d sum_hi = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = load8(src + i);
    if constexpr (kCheck == Check::kInput) {
      nonfinite = _mm256_or_ps(nonfinite, nonfinite_mask(x));
    }
    const __m256 y = store8(dst + i, _mm256_mul_ps(x, vscale));
    if constexpr (kCheck == Check::kOutput) {
      nonfinite = _mm256_or_ps(nonfinite, nonfinite_mask(y));
    }
    if constexpr (kSumSq) {
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(y));
      const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1));
      sum_lo = _mm256_fmadd_pd(lo, lo, sum_lo);
      sum_hi = _mm256_fmadd_pd(hi, hi, sum_hi);
    }
  }
  if constexpr (kCheck != Check::kNone) {
    stats.nonfinite |= _mm256_movemask_ps(nonfinite) != 0;
  }
  if constexpr (kSumSq) {
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, _mm256_add_pd(sum_lo, sum_hi));
    stats.sum_sq += (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }
  span_scalar<S, D, kCheck, kSumSq>(src + i, dst + i, n - i, scale, stats);
}

#endif  // HETCOMM_HAS_AVX2_PATH

}  // namespace hetcomm::cpu
