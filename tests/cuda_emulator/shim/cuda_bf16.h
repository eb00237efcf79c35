// Stand-in for <cuda_bf16.h>: the one intrinsic the kernels use (on sm_80 and newer),
// with the semantics of its instruction, cvt.rn.bf16.f32: round to nearest even, NaN
// to the canonical 0x7FFF (as NVIDIA's own host version in cuda_bf16.hpp).
#pragma once

#include <cstring>

struct __nv_bfloat16 {
  unsigned short x;
};

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) {
  return h.x;
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  unsigned int x;
  std::memcpy(&x, &f, sizeof x);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
    return __nv_bfloat16{0x7FFF};
  }
  return __nv_bfloat16{static_cast<unsigned short>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16)};
}
