// CPU kernels of the hetcomm ops: validate and plan (ops/plans), then run the
// segment list (cpu/multi_tensor_cpu).
#include "cpu/multi_tensor_cpu.h"
#include "ops/plans.h"

#include <torch/library.h>

namespace hetcomm::cpu {
namespace {

float read_scalar(const at::Tensor& t) {
  return *t.const_data_ptr<float>();
}

void pack_out_cpu(at::TensorList src, const at::Tensor& scale, at::Tensor& out) {
  run_segments(plan_pack(src, scale, out), read_scalar(scale), Work::kScaleCast);
}

at::Tensor pack_cpu(at::TensorList src, const at::Tensor& scale, c10::ScalarType dtype) {
  at::Tensor out = empty_pack_output(src, scale, dtype);
  pack_out_cpu(src, scale, out);
  return out;
}

void unpack_cpu(const at::Tensor& flat, at::TensorList dst, const at::Tensor& scale, at::Tensor& found_inf,
                const std::optional<at::Tensor>& sq_norm) {
  const SegmentList segments = plan_unpack(flat, dst, scale, found_inf, sq_norm);
  const Work work = sq_norm.has_value() ? Work::kScaleCastCheckOutputSumSq : Work::kScaleCastCheckOutput;
  const SpanStats stats = run_segments(segments, read_scalar(scale), work);
  if (stats.nonfinite) {
    *found_inf.mutable_data_ptr<float>() = 1.0f;
  }
  if (sq_norm.has_value()) {
    *sq_norm->mutable_data_ptr<float>() += static_cast<float>(stats.sum_sq);
  }
}

void unscale_cpu(at::TensorList tensors, const at::Tensor& inv_scale, at::Tensor& found_inf) {
  const SegmentList segments = plan_unscale(tensors, inv_scale, found_inf);
  if (run_segments(segments, read_scalar(inv_scale), Work::kScaleCastCheckInput).nonfinite) {
    *found_inf.mutable_data_ptr<float>() = 1.0f;
  }
}

void cast_cpu(at::TensorList src, at::TensorList dst) {
  run_segments(plan_cast(src, dst), 1.0f, Work::kScaleCast);
}

}  // namespace

TORCH_LIBRARY_IMPL(hetcomm, CPU, m) {
  m.impl("pack", &pack_cpu);
  m.impl("pack.out", &pack_out_cpu);
  m.impl("unpack_", &unpack_cpu);
  m.impl("unscale_", &unscale_cpu);
  m.impl("cast_", &cast_cpu);
}

}  // namespace hetcomm::cpu
