// adamw_'s CPU kernel: one pass per element from the gradient (any float dtype, times
// grad_scale) through the fp32 master and moments to the master's 16-bit copy. The
// scalar and the AVX2 loops do the same fp32 operations in the same order, one
// rounding each (the build disables contraction into FMAs), so both give the bits of
// hetcomm.reference.adamw_.
#include "cpu/chunks.h"
#include "cpu/multi_tensor_cpu.h"
#include "cpu/span_kernels.h"
#include "ops/adamw_plan.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>

namespace hetcomm::cpu {
namespace {

template <typename G, typename C, bool kCopy>
void adamw_scalar(const G* grad, float* param, float* exp_avg, float* exp_avg_sq, C* copy, int64_t n,
                  float grad_scale, const AdamWConstants& k) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = static_cast<float>(grad[i]) * grad_scale;
    const float avg = exp_avg[i] + (g - exp_avg[i]) * k.beta1_weight;
    const float sq = exp_avg_sq[i] * k.beta2 + (g * g) * k.beta2_weight;
    const float denom = std::sqrt(sq) / k.bias_correction2_sqrt + k.eps;
    const float p = param[i] * k.decay + (avg / denom) * k.neg_step_size;
    exp_avg[i] = avg;
    exp_avg_sq[i] = sq;
    param[i] = p;
    if constexpr (kCopy) {
      copy[i] = static_cast<C>(p);
    }
  }
}

#if HETCOMM_HAS_AVX2_PATH

template <typename G, typename C, bool kCopy>
HETCOMM_TARGET_AVX2 void adamw_avx2(const G* grad, float* param, float* exp_avg, float* exp_avg_sq, C* copy,
                                    int64_t n, float grad_scale, const AdamWConstants& k) {
  const __m256 scale = _mm256_set1_ps(grad_scale);
  const __m256 beta1_weight = _mm256_set1_ps(k.beta1_weight);
  const __m256 beta2 = _mm256_set1_ps(k.beta2);
  const __m256 beta2_weight = _mm256_set1_ps(k.beta2_weight);
  const __m256 correction2 = _mm256_set1_ps(k.bias_correction2_sqrt);
  const __m256 eps = _mm256_set1_ps(k.eps);
  const __m256 decay = _mm256_set1_ps(k.decay);
  const __m256 neg_step_size = _mm256_set1_ps(k.neg_step_size);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_mul_ps(load8(grad + i), scale);
    const __m256 m = _mm256_loadu_ps(exp_avg + i);
    const __m256 avg = _mm256_add_ps(m, _mm256_mul_ps(_mm256_sub_ps(g, m), beta1_weight));
    const __m256 sq = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(exp_avg_sq + i), beta2),
                                    _mm256_mul_ps(_mm256_mul_ps(g, g), beta2_weight));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(sq), correction2), eps);
    const __m256 p = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(param + i), decay),
                                   _mm256_mul_ps(_mm256_div_ps(avg, denom), neg_step_size));
    _mm256_storeu_ps(exp_avg + i, avg);
    _mm256_storeu_ps(exp_avg_sq + i, sq);
    _mm256_storeu_ps(param + i, p);
    if constexpr (kCopy) {
      store8(copy + i, p);
    }
  }
  adamw_scalar<G, C, kCopy>(grad + i, param + i, exp_avg + i, exp_avg_sq + i, kCopy ? copy + i : copy, n - i,
                            grad_scale, k);
}

#endif  // HETCOMM_HAS_AVX2_PATH

using AdamWFn = void (*)(const AdamWSegment& segment, int64_t local, int64_t n, float grad_scale,
                         const AdamWConstants& k);

template <typename G, typename C, bool kCopy>
void adamw_piece(const AdamWSegment& s, int64_t local, int64_t n, float grad_scale, const AdamWConstants& k) {
  const G* grad = static_cast<const G*>(s.grad) + local;
  C* copy = kCopy ? static_cast<C*>(s.copy) + local : nullptr;
#if HETCOMM_HAS_AVX2_PATH
  if (use_avx2()) {
    adamw_avx2<G, C, kCopy>(grad, s.param + local, s.exp_avg + local, s.exp_avg_sq + local, copy, n, grad_scale,
                            k);
    return;
  }
#endif
  adamw_scalar<G, C, kCopy>(grad, s.param + local, s.exp_avg + local, s.exp_avg_sq + local, copy, n, grad_scale, k);
}

template <typename G>
AdamWFn select_copy(c10::ScalarType copy) {
  switch (copy) {
    case c10::ScalarType::Undefined:
      return &adamw_piece<G, float, false>;
    case c10::ScalarType::Float:
      return &adamw_piece<G, float, true>;
    case c10::ScalarType::Half:
      return &adamw_piece<G, c10::Half, true>;
    case c10::ScalarType::BFloat16:
      return &adamw_piece<G, c10::BFloat16, true>;
    default:
      TORCH_CHECK(false, "hetcomm.adamw_: unsupported copy dtype ", copy);
  }
}

AdamWFn select_adamw(c10::ScalarType grad, c10::ScalarType copy) {
  switch (grad) {
    case c10::ScalarType::Float:
      return select_copy<float>(copy);
    case c10::ScalarType::Half:
      return select_copy<c10::Half>(copy);
    case c10::ScalarType::BFloat16:
      return select_copy<c10::BFloat16>(copy);
    default:
      TORCH_CHECK(false, "hetcomm.adamw_: unsupported gradient dtype ", grad);
  }
}

void adamw_cpu(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList copies, const at::Tensor& grad_scale, const at::Tensor& found_inf,
               const at::Tensor& step, double lr, double beta1, double beta2, double eps, double weight_decay) {
  const AdamWPlan plan = plan_adamw(grads, params, exp_avgs, exp_avg_sqs, copies, grad_scale, found_inf, step, lr,
                                    beta1, beta2, eps, weight_decay);
  if (*found_inf.const_data_ptr<float>() != 0.0f) {
    return;   // an overflow somewhere: the step is skipped, nothing changes
  }
  const AdamWConstants constants = adamw_constants(plan.hyper, *step.const_data_ptr<float>());
  const float scale = *grad_scale.const_data_ptr<float>();
  const size_t count = plan.segments.size();
  std::vector<int64_t> offsets(count + 1, 0);
  std::vector<AdamWFn> pieces(count);
  for (size_t k = 0; k < count; ++k) {
    offsets[k + 1] = offsets[k] + plan.segments[k].numel;
    pieces[k] = select_adamw(plan.segments[k].grad_type, plan.segments[k].copy_type);
  }
  for_each_piece(offsets, [&](int64_t /*chunk*/, size_t k, int64_t local, int64_t n) {
    pieces[k](plan.segments[k], local, n, scale, constants);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hetcomm, CPU, m) {
  m.impl("adamw_", &adamw_cpu);
}

}  // namespace hetcomm::cpu
