// Checks the shim's conversion intrinsics (shim/cuda_fp16.h, shim/cuda_bf16.h) over
// every input: float -> half against the CPU's F16C instruction (IEEE round to nearest
// even, as cvt.rn.f16.f32; NaNs need only stay NaN), half -> float against F16C, and
// float -> bf16 against round to nearest even written another way. Prints the number
// of mismatches; exits 0 if none, 1 otherwise, 77 where the CPU has no F16C.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "cuda_bf16.h"
#include "cuda_fp16.h"

namespace {

__attribute__((target("f16c"))) unsigned short f16c_from_float(float f) {
  return static_cast<unsigned short>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}

__attribute__((target("f16c"))) float f16c_to_float(unsigned short h) {
  return _cvtsh_ss(h);
}

unsigned short bf16_nearest_even(uint32_t bits) {
  uint32_t truncated = bits >> 16;
  const uint32_t rest = bits & 0xFFFFu;
  if (rest > 0x8000u || (rest == 0x8000u && (truncated & 1u))) {
    ++truncated;
  }
  return static_cast<unsigned short>(truncated);
}

// Mismatches among the floats whose bit patterns are first, first + step, ...
uint64_t check_floats(uint64_t first, uint64_t step) {
  uint64_t bad = 0;
  for (uint64_t i = first; i <= 0xFFFFFFFFull; i += step) {
    const uint32_t bits = static_cast<uint32_t>(i);
    float f;
    std::memcpy(&f, &bits, sizeof f);
    const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
    const unsigned short half = __half_as_ushort(__float2half_rn(f));
    if (nan ? (half & 0x7FFFu) <= 0x7C00u : half != f16c_from_float(f)) {
      ++bad;
    }
    const unsigned short bf16 = __bfloat16_as_ushort(__float2bfloat16_rn(f));
    if (nan ? (bf16 & 0x7FFFu) <= 0x7F80u : bf16 != bf16_nearest_even(bits)) {
      ++bad;
    }
  }
  return bad;
}

}  // namespace

int main() {
  if (!__builtin_cpu_supports("f16c")) {
    std::puts("this CPU has no F16C");
    return 77;
  }
  const unsigned workers = std::max(1u, std::thread::hardware_concurrency());
  std::vector<uint64_t> bad(workers);
  std::vector<std::thread> threads;
  for (unsigned w = 0; w < workers; ++w) {
    threads.emplace_back([&bad, w, workers] { bad[w] = check_floats(w, workers); });
  }
  uint64_t mismatches = 0;
  for (unsigned w = 0; w < workers; ++w) {
    threads[w].join();
    mismatches += bad[w];
  }
  for (uint32_t h = 0; h <= 0xFFFFu; ++h) {
    const float got = __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
    const float want = f16c_to_float(static_cast<unsigned short>(h));
    if (std::memcmp(&got, &want, sizeof got) != 0 && !(got != got && want != want)) {
      ++mismatches;
    }
  }
  std::printf("%llu mismatches\n", static_cast<unsigned long long>(mismatches));
  return mismatches == 0 ? 0 : 1;
}
