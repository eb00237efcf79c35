// adamw_: the fused AdamW step of fp32 master weights, validated and turned into a
// list of segments, independent of the device that runs it. Like the other plans,
// it either throws (nothing written yet) or returns the complete list of work.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace hetcomm {

// One parameter's elements: its gradient (any float dtype), its fp32 master and
// moments, and where its 16-bit copy goes (copy == nullptr: no copy).
struct AdamWSegment {
  const void* grad;
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  void* copy;
  int64_t numel;
  c10::ScalarType grad_type;
  c10::ScalarType copy_type;
};

// The step's hyper-parameters as given (Python floats are doubles): the constants
// the elements use are computed from them in double and rounded to fp32 once, as
// torch's AdamW does with its Python floats.
struct AdamWHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
};

// What every element of the step uses. step_size and bias_correction2_sqrt depend on
// the step count, which stays on the device: adamw_constants computes them there.
struct AdamWConstants {
  float decay;                  // 1 - lr * weight_decay
  float beta1_weight;           // 1 - beta1: exp_avg += (grad - exp_avg) * (1 - beta1)
  float beta2;
  float beta2_weight;           // 1 - beta2
  float eps;
  float neg_step_size;          // -lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
};

struct AdamWPlan {
  std::vector<AdamWSegment> segments;
  AdamWHyper hyper;
};

AdamWPlan plan_adamw(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList copies, const at::Tensor& grad_scale,
                     const at::Tensor& found_inf, const at::Tensor& step, double lr, double beta1, double beta2,
                     double eps, double weight_decay);

// The constants of a step at `step` (the count after it, >= 1): in double, as torch's
// AdamW computes them on the host, then rounded to fp32. Host and device code.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline AdamWConstants adamw_constants(const AdamWHyper& h, float step) {
  const double bias_correction1 = 1.0 - pow(h.beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - pow(h.beta2, static_cast<double>(step));
  return {static_cast<float>(1.0 - h.lr * h.weight_decay), static_cast<float>(1.0 - h.beta1),
          static_cast<float>(h.beta2), static_cast<float>(1.0 - h.beta2), static_cast<float>(h.eps),
          static_cast<float>(-(h.lr / bias_correction1)), static_cast<float>(sqrt(bias_correction2))};
}

}  // namespace hetcomm
