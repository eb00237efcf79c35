#include "ops/adamw_plan.h"

#include "ops/checks.h"

#include <c10/util/Exception.h>

#include <string>

namespace hetcomm {
namespace {

constexpr const char* kOp = "adamw_";

std::string item(const char* name, size_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

// A list of fp32 tensors, one per parameter, each of its parameter's element count.
void check_state_list(const char* name, at::TensorList list, at::TensorList params, const c10::Device& device) {
  TORCH_CHECK(list.size() == params.size(), "hetcomm.", kOp, ": ", name, " has ", list.size(),
              " tensors but params has ", params.size(), "; expected one per parameter");
  for (size_t i = 0; i < list.size(); ++i) {
    check_float_tensor(kOp, item(name, i), list[i], device);
    TORCH_CHECK_TYPE(list[i].scalar_type() == c10::ScalarType::Float, "hetcomm.", kOp, ": ", item(name, i),
                     " has dtype ", dtype_name(list[i].scalar_type()), "; expected torch.float32");
    TORCH_CHECK(list[i].numel() == params[i].numel(), "hetcomm.", kOp, ": ", item(name, i), " has ",
                list[i].numel(), " elements but params[", i, "] has ", params[i].numel(), "; expected as many");
  }
}

// grads and copies: one tensor per parameter, or one flat 1-D buffer of all their
// elements in list order. Returns whether it is the flat form.
bool check_per_parameter_or_flat(const char* name, at::TensorList list, at::TensorList params, int64_t total,
                                 const c10::Device& device) {
  const bool flat = list.size() == 1 && params.size() > 1;
  TORCH_CHECK(flat || list.size() == params.size(), "hetcomm.", kOp, ": ", name, " has ", list.size(),
              " tensors; expected one per parameter (", params.size(), ") or one flat 1-D buffer of their ", total,
              " elements");
  for (size_t i = 0; i < list.size(); ++i) {
    check_float_tensor(kOp, item(name, i), list[i], device);
  }
  if (flat) {
    TORCH_CHECK(list[0].dim() == 1, "hetcomm.", kOp, ": ", name, "[0], a flat buffer, must be 1-D; got shape ",
                list[0].sizes());
    TORCH_CHECK(list[0].numel() == total, "hetcomm.", kOp, ": ", name, "[0], a flat buffer, has ", list[0].numel(),
                " elements but params hold ", total, " in all; expected exactly that many");
    return true;
  }
  for (size_t i = 0; i < list.size(); ++i) {
    TORCH_CHECK(list[i].numel() == params[i].numel(), "hetcomm.", kOp, ": ", item(name, i), " has ",
                list[i].numel(), " elements but params[", i, "] has ", params[i].numel(), "; expected as many");
  }
  return false;
}

void check_hyper(const AdamWHyper& h) {
  const auto finite_at_least_zero = [](double v) { return v >= 0.0 && v < INFINITY; };
  TORCH_CHECK(finite_at_least_zero(h.lr), "hetcomm.", kOp, ": lr = ", h.lr, "; expected a finite number >= 0");
  TORCH_CHECK(h.beta1 >= 0.0 && h.beta1 < 1.0, "hetcomm.", kOp, ": beta1 = ", h.beta1, "; expected 0 <= beta1 < 1");
  TORCH_CHECK(h.beta2 >= 0.0 && h.beta2 < 1.0, "hetcomm.", kOp, ": beta2 = ", h.beta2, "; expected 0 <= beta2 < 1");
  TORCH_CHECK(finite_at_least_zero(h.eps), "hetcomm.", kOp, ": eps = ", h.eps, "; expected a finite number >= 0");
  TORCH_CHECK(finite_at_least_zero(h.weight_decay), "hetcomm.", kOp, ": weight_decay = ", h.weight_decay,
              "; expected a finite number >= 0");
}

}  // namespace

AdamWPlan plan_adamw(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList copies, const at::Tensor& grad_scale,
                     const at::Tensor& found_inf, const at::Tensor& step, double lr, double beta1, double beta2,
                     double eps, double weight_decay) {
  const AdamWHyper hyper{lr, beta1, beta2, eps, weight_decay};
  check_hyper(hyper);
  const c10::Device device = list_device(kOp, "params", params);
  check_float_list(kOp, "params", params, device);
  int64_t total = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK_TYPE(params[i].scalar_type() == c10::ScalarType::Float, "hetcomm.", kOp, ": ", item("params", i),
                     " has dtype ", dtype_name(params[i].scalar_type()),
                     "; expected torch.float32 (the fp32 master weights)");
    total += params[i].numel();
  }
  check_state_list("exp_avgs", exp_avgs, params, device);
  check_state_list("exp_avg_sqs", exp_avg_sqs, params, device);
  const bool flat_grads = check_per_parameter_or_flat("grads", grads, params, total, device);
  const bool flat_copies = !copies.empty() && check_per_parameter_or_flat("copies", copies, params, total, device);
  check_scalar_tensor(kOp, "grad_scale", grad_scale, device);
  check_scalar_tensor(kOp, "found_inf", found_inf, device);
  check_scalar_tensor(kOp, "step", step, device);

  std::vector<Region> regions{{"grad_scale", &grad_scale, false}, {"found_inf", &found_inf, false},
                              {"step", &step, false}};
  add_regions(regions, "grads", grads, false);
  add_regions(regions, "params", params, true);
  add_regions(regions, "exp_avgs", exp_avgs, true);
  add_regions(regions, "exp_avg_sqs", exp_avg_sqs, true);
  add_regions(regions, "copies", copies, true);
  check_no_overlap(kOp, regions);

  AdamWPlan plan{{}, hyper};
  plan.segments.reserve(params.size());
  int64_t offset = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& grad = flat_grads ? grads[0] : grads[i];
    const int64_t grad_offset = flat_grads ? offset : 0;
    AdamWSegment segment{static_cast<const char*>(grad.const_data_ptr()) + grad_offset * grad.element_size(),
                         params[i].mutable_data_ptr<float>(), exp_avgs[i].mutable_data_ptr<float>(),
                         exp_avg_sqs[i].mutable_data_ptr<float>(), nullptr, params[i].numel(),
                         grad.scalar_type(), c10::ScalarType::Undefined};
    if (!copies.empty()) {
      const at::Tensor& copy = flat_copies ? copies[0] : copies[i];
      const int64_t copy_offset = flat_copies ? offset : 0;
      segment.copy = static_cast<char*>(copy.data_ptr()) + copy_offset * copy.element_size();
      segment.copy_type = copy.scalar_type();
    }
    plan.segments.push_back(segment);
    offset += params[i].numel();
  }
  return plan;
}

}  // namespace hetcomm
