// adamw_: the fused AdamW step of fp32 master weights, validated and turned into a
// list of segments, independent of the device that runs it. Like the other plans,
// it either throws (nothing written yet) or returns the complete list of work.
#pragma once

#include "kernels/adamw_math.h"
#include "ops/adamw_segment.h"

#include <ATen/core/Tensor.h>

namespace hetcomm {

struct AdamWPlan {
  AdamWSegmentList segments;
  AdamWHyper hyper;
};

AdamWPlan plan_adamw(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList copies, const at::Tensor& grad_scale,
                     const at::Tensor& found_inf, const at::Tensor& step, double lr, double beta1, double beta2,
                     double eps, double weight_decay);

}  // namespace hetcomm
