// Stand-in for <cuda_fp16.h>: the __half intrinsics the kernels use, with the
// semantics of their instructions (cvt.f32.f16 exact; cvt.rn.f16.f32: round to nearest
// even, overflow to inf, NaN to the canonical 0x7FFF, as NVIDIA's host version in
// cuda_fp16.hpp). Checked against the CPU's F16C over every float: selfcheck/.
#pragma once

#include <cstring>

struct __half {
  unsigned short x;
};

inline __half __ushort_as_half(unsigned short bits) { return __half{bits}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }

// cvt.f32.f16: exact.
inline float __half2float(__half h) {
  const unsigned int sign = (h.x & 0x8000u) << 16;
  const unsigned int exponent = (h.x >> 10) & 0x1Fu;
  unsigned int mantissa = h.x & 0x3FFu;
  unsigned int bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);  // inf, or NaN with its payload
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      ++e;
      mantissa <<= 1;
    } while ((mantissa & 0x400u) == 0);
    bits = sign | ((112 - e) << 23) | ((mantissa & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// cvt.rn.f16.f32.
inline __half __float2half_rn(float f) {
  unsigned int x;
  std::memcpy(&x, &f, 4);
  const unsigned int u = x & 0x7FFFFFFFu;
  const unsigned int sign = (x >> 16) & 0x8000u;
  if (u > 0x7F800000u) {
    return __half{0x7FFF};
  }
  if (u == 0x7F800000u) {
    return __half{static_cast<unsigned short>(sign | 0x7C00u)};
  }
  if (u >= 0x477FF000u) {  // rounds to or past 65520: inf
    return __half{static_cast<unsigned short>(sign | 0x7C00u)};
  }
  if (u >= 0x38800000u) {  // normal half
    const unsigned int mant = u & 0x7FFFFFu;
    const unsigned int exp = (u >> 23) - 112;
    unsigned int h = (exp << 10) | (mant >> 13);
    const unsigned int rest = mant & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) {
      ++h;  // may carry into the exponent: correct
    }
    return __half{static_cast<unsigned short>(sign | h)};
  }
  if (u < 0x33000001u) {  // at most half the smallest subnormal: zero (ties to even 0)
    return __half{static_cast<unsigned short>(sign)};
  }
  // subnormal half: value = mant24 * 2^(e-150), result units 2^-24
  const unsigned int e = u >> 23;
  const unsigned int mant = (u & 0x7FFFFFu) | 0x800000u;
  const unsigned int shift = 126 - e;  // 14..24 (e in 102..112)
  unsigned int h = mant >> shift;
  const unsigned int rest = mant & ((1u << shift) - 1);
  const unsigned int halfway = 1u << (shift - 1);
  if (rest > halfway || (rest == halfway && (h & 1u))) {
    ++h;
  }
  return __half{static_cast<unsigned short>(sign | h)};
}
