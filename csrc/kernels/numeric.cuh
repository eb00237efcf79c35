// Element types of the CUDA kernels and their conversions to and from fp32, bit-exact
// with torch's own conversions. No torch header and no C++ standard header, so that
// NVRTC can compile this file for the legacy targets (sm_60..sm_75) on a machine
// without a CUDA 12 nvcc (see csrc/kernels/compile_with_nvrtc.py).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace hetcomm::kernels {

// 16-bit values travel as raw bits: the kernels only ever convert them to and from
// fp32, and raw bits keep the vector loads plain integer moves.
struct F32 {
  using Storage = float;
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float v) { return v; }
};

struct F16 {
  using Storage = unsigned short;
  static __device__ __forceinline__ float load(unsigned short bits) { return __half2float(__ushort_as_half(bits)); }
  // cvt.rn.f16.f32 exists on every target: the same round-to-nearest-even as torch.
  static __device__ __forceinline__ unsigned short store(float v) { return __half_as_ushort(__float2half_rn(v)); }
};

struct BF16 {
  using Storage = unsigned short;
  static __device__ __forceinline__ float load(unsigned short bits) {
    return __uint_as_float(static_cast<unsigned int>(bits) << 16);
  }
  static __device__ __forceinline__ unsigned short store(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));  // one cvt.rn.bf16.f32 instruction
#else
    // No bf16 conversion instruction before sm_80: round to nearest even on the bit
    // pattern, NaN to the quiet 0x7FC0, exactly as c10::BFloat16 does on the CPU.
    const unsigned int bits = __float_as_uint(v);
    if (v != v) {
      return 0x7FC0;
    }
    return static_cast<unsigned short>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
#endif
  }
};

// ±inf or NaN: all exponent bits set. A bit test needs no math library, so it
// compiles the same under nvcc and NVRTC.
__device__ __forceinline__ bool is_nonfinite(float v) {
  return (__float_as_uint(v) & 0x7F800000u) == 0x7F800000u;
}

}  // namespace hetcomm::kernels
