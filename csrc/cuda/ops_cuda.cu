// CUDA kernels of the hetcomm ops: validate and plan (ops/plans, ops/adamw_plan), then
// run the segment list on the current stream (cuda/multi_tensor_cuda, cuda/adamw_cuda).
// Scales, found_inf, sq_norm and adamw_'s step are read and written by the kernels on
// the device: no host synchronisation. Also the private launch-shape override that
// benchmarks/sweep_launch.py times the kernels under (cuda/launch_shape.h).
#include "cuda/adamw_cuda.h"
#include "cuda/hooks.h"
#include "cuda/launch_shape.h"
#include "cuda/multi_tensor_cuda.h"
#include "ops/adamw_plan.h"
#include "ops/plans.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

namespace hetcomm::cuda {
namespace {

// Runs a validated plan on `device` (which the plan checked every tensor is on).
void run_on(const c10::Device& device, const SegmentList& segments, const float* scale, Work work,
            float* found_inf = nullptr, double* partials = nullptr) {
  const c10::cuda::CUDAGuard guard(device);
  run_segments(segments, scale, work, found_inf, partials, device,
               c10::cuda::getCurrentCUDAStream(device.index()).stream());
}

void pack_out_cuda(at::TensorList src, const at::Tensor& scale, at::Tensor& out) {
  const SegmentList segments = plan_pack(src, scale, out);
  run_on(out.device(), segments, scale.const_data_ptr<float>(), Work::kScaleCast);
}

at::Tensor pack_cuda(at::TensorList src, const at::Tensor& scale, c10::ScalarType dtype) {
  at::Tensor out = empty_pack_output(src, scale, dtype);
  pack_out_cuda(src, scale, out);
  return out;
}

void unpack_cuda(const at::Tensor& flat, at::TensorList dst, const at::Tensor& scale, at::Tensor& found_inf,
                 const std::optional<at::Tensor>& sq_norm) {
  const SegmentList segments = plan_unpack(flat, dst, scale, found_inf, sq_norm);
  if (!sq_norm.has_value()) {
    run_on(flat.device(), segments, scale.const_data_ptr<float>(), Work::kScaleCastCheckOutput,
           found_inf.mutable_data_ptr<float>());
    return;
  }
  // One partial sum per chunk, added up in chunk order by a second launch: the same
  // bits on every run, unlike float atomics whose order changes run to run.
  const int64_t chunks = count_chunks(segments);
  if (chunks == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(flat.device());
  const at::Tensor partials = at::empty({chunks}, flat.options().dtype(at::kDouble));
  run_on(flat.device(), segments, scale.const_data_ptr<float>(), Work::kScaleCastCheckOutputSumSq,
         found_inf.mutable_data_ptr<float>(), partials.mutable_data_ptr<double>());
  add_sum_of_squares(partials.const_data_ptr<double>(), chunks, sq_norm->mutable_data_ptr<float>(),
                     c10::cuda::getCurrentCUDAStream(flat.device().index()).stream());
}

void unscale_cuda(at::TensorList tensors, const at::Tensor& inv_scale, at::Tensor& found_inf) {
  const SegmentList segments = plan_unscale(tensors, inv_scale, found_inf);
  run_on(found_inf.device(), segments, inv_scale.const_data_ptr<float>(), Work::kScaleCastCheckInput,
         found_inf.mutable_data_ptr<float>());
}

void cast_cuda(at::TensorList src, at::TensorList dst) {
  const SegmentList segments = plan_cast(src, dst);
  run_on(src[0].device(), segments, nullptr, Work::kScaleCast);
}

void adamw_cuda(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList copies, const at::Tensor& grad_scale, const at::Tensor& found_inf,
                const at::Tensor& step, double lr, double beta1, double beta2, double eps, double weight_decay) {
  const AdamWPlan plan = plan_adamw(grads, params, exp_avgs, exp_avg_sqs, copies, grad_scale, found_inf, step, lr,
                                    beta1, beta2, eps, weight_decay);
  const c10::Device device = params[0].device();
  const c10::cuda::CUDAGuard guard(device);
  run_adamw(plan.segments, plan.hyper, grad_scale.const_data_ptr<float>(), found_inf.const_data_ptr<float>(),
            step.const_data_ptr<float>(), device, c10::cuda::getCurrentCUDAStream(device.index()).stream());
}

}  // namespace

HETCOMM_CUDA_REGISTRATION(m) {
  m.impl("pack", &pack_cuda);
  m.impl("pack.out", &pack_out_cuda);
  m.impl("unpack_", &unpack_cuda);
  m.impl("unscale_", &unscale_cuda);
  m.impl("cast_", &cast_cuda);
  m.impl("adamw_", &adamw_cuda);
}

HETCOMM_CUDA_SETTINGS_REGISTRATION(m) {
  m.impl("_set_launch_shape", &override_launch_shape);
  m.impl("_clear_launch_shape", &clear_launch_shape_override);
}

}  // namespace hetcomm::cuda
