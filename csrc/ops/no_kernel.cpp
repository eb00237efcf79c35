// The kernels the dispatcher falls back to (CompositeExplicitAutograd) when no
// device-specific kernel applies: a call whose lists are all empty (so no tensor
// selects a device) or tensors on a device this build has no kernel for. Each runs
// the op's checks, so the user sees the named-argument error, and otherwise says
// which kernel is missing instead of the dispatcher's generic message. In a build
// without CUDA kernels, the same for the launch-shape override (the CUDA build's is in
// cuda/ops_cuda.cu, under the same dispatch key).
#include "ops/adamw_plan.h"
#include "ops/plans.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

namespace hetcomm {
namespace {

[[noreturn]] void no_kernel(const char* op, const c10::Device& device) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "hetcomm.", op, ": this build of hetcomm has no kernel for ",
                              device.type(), " tensors; hetcomm.info() lists the kernels it has");
}

void pack_out_no_kernel(at::TensorList src, const at::Tensor& scale, at::Tensor& out) {
  plan_pack(src, scale, out);
  no_kernel("pack", out.device());
}

at::Tensor pack_no_kernel(at::TensorList src, const at::Tensor& scale, c10::ScalarType /*dtype*/) {
  check_pack_sources(src, scale);
  no_kernel("pack", src[0].device());
}

void unpack_no_kernel(const at::Tensor& flat, at::TensorList dst, const at::Tensor& scale,
                      at::Tensor& found_inf, const std::optional<at::Tensor>& sq_norm) {
  plan_unpack(flat, dst, scale, found_inf, sq_norm);
  no_kernel("unpack_", flat.device());
}

void unscale_no_kernel(at::TensorList tensors, const at::Tensor& inv_scale, at::Tensor& found_inf) {
  plan_unscale(tensors, inv_scale, found_inf);
  no_kernel("unscale_", found_inf.device());
}

void cast_no_kernel(at::TensorList src, at::TensorList dst) {
  plan_cast(src, dst);
  no_kernel("cast_", src[0].device());
}

void adamw_no_kernel(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList copies, const at::Tensor& grad_scale,
                     const at::Tensor& found_inf, const at::Tensor& step, double lr, double beta1, double beta2,
                     double eps, double weight_decay) {
  plan_adamw(grads, params, exp_avgs, exp_avg_sqs, copies, grad_scale, found_inf, step, lr, beta1, beta2, eps,
             weight_decay);
  no_kernel("adamw_", params[0].device());
}

#ifndef HETCOMM_WITH_CUDA
[[noreturn]] void no_cuda_kernels(const char* op) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "hetcomm.", op, ": this build of hetcomm has no CUDA kernels, whose launch ",
                              "shape it sets; hetcomm.info() lists the kernels it has");
}

void set_launch_shape_no_kernel(int64_t /*blocks_per_sm*/, int64_t /*items_per_thread*/) {
  no_cuda_kernels("_set_launch_shape");
}

void clear_launch_shape_no_kernel() {
  no_cuda_kernels("_clear_launch_shape");
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(hetcomm, CompositeExplicitAutograd, m) {
  m.impl("pack", &pack_no_kernel);
  m.impl("pack.out", &pack_out_no_kernel);
  m.impl("unpack_", &unpack_no_kernel);
  m.impl("unscale_", &unscale_no_kernel);
  m.impl("cast_", &cast_no_kernel);
  m.impl("adamw_", &adamw_no_kernel);
#ifndef HETCOMM_WITH_CUDA
  m.impl("_set_launch_shape", &set_launch_shape_no_kernel);
  m.impl("_clear_launch_shape", &clear_launch_shape_no_kernel);
#endif
}

}  // namespace hetcomm
