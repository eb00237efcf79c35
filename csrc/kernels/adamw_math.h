// adamw_'s per-step constants, computed the same way by the CPU kernel (host code)
// and the CUDA kernel (device code). No header under NVRTC, which has pow and sqrt on
// doubles built in (see numeric.cuh); <cmath> for the host and nvcc.
#pragma once

#if !defined(__CUDACC_RTC__)
#include <cmath>
#endif

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define HETCOMM_HOST_DEVICE __host__ __device__
#else
#define HETCOMM_HOST_DEVICE
#endif

namespace hetcomm {

// The step's hyper-parameters as given (Python floats are doubles).
struct AdamWHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
};

// What every element of the step uses, each computed in double and rounded to fp32
// once, as torch's AdamW does with its Python floats.
struct AdamWConstants {
  float decay;                  // 1 - lr * weight_decay
  float beta1_weight;           // 1 - beta1: exp_avg += (grad - exp_avg) * (1 - beta1)
  float beta2;
  float beta2_weight;           // 1 - beta2
  float eps;
  float neg_step_size;          // -lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
};

// The constants of a step at `step` (the count after it, >= 1): the bias corrections
// in double, as torch's AdamW computes them on the host from its step count.
HETCOMM_HOST_DEVICE inline AdamWConstants adamw_constants(const AdamWHyper& h, float step) {
  const double bias_correction1 = 1.0 - pow(h.beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - pow(h.beta2, static_cast<double>(step));
  return {static_cast<float>(1.0 - h.lr * h.weight_decay), static_cast<float>(1.0 - h.beta1),
          static_cast<float>(h.beta2), static_cast<float>(1.0 - h.beta2), static_cast<float>(h.eps),
          static_cast<float>(-(h.lr / bias_correction1)), static_cast<float>(sqrt(bias_correction2))};
}

}  // namespace hetcomm
