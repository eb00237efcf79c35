// The operator schemas, written once for every back end. Mutated arguments carry
// (a!) annotations so that torch.compile and the dispatcher know what each op writes.
#include <torch/library.h>

TORCH_LIBRARY(hetcomm, m) {
  // concat(src[k].flatten() * scale) cast to `dtype`, round-to-nearest-even, one pass.
  m.def("pack(Tensor[] src, Tensor scale, ScalarType dtype) -> Tensor");
  // The same into a caller's 1-D buffer; the wire dtype is out's dtype.
  m.def("pack.out(Tensor[] src, Tensor scale, *, Tensor(a!) out) -> ()");
  // dst[k] = cast(flat[segment k] * scale); found_inf = 1 if any written value is
  // non-finite (never cleared); sq_norm += sum of squares of the written values.
  m.def(
      "unpack_(Tensor flat, Tensor(a!)[] dst, Tensor scale, Tensor(b!) found_inf, "
      "Tensor(c!)? sq_norm=None) -> ()");
  // GradScaler's unscale: found_inf = 1 if any input value is non-finite; t *= inv_scale.
  m.def("unscale_(Tensor(a!)[] tensors, Tensor inv_scale, Tensor(b!) found_inf) -> ()");
  // dst[k] = src[k] with a dtype conversion (master weights <-> model weights).
  m.def("cast_(Tensor[] src, Tensor(a!)[] dst) -> ()");
  // AdamW on fp32 masters (torch.optim.AdamW's update), one pass: g = grads[k] * grad_scale;
  // params, exp_avgs, exp_avg_sqs updated in place; copies (none, one per parameter, or
  // one flat buffer) = the new params cast. step: the count after this step, on the
  // device. found_inf != 0: nothing is written. grads: one per parameter or one flat buffer.
  m.def(
      "adamw_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] copies, Tensor grad_scale, Tensor found_inf, Tensor step, float lr, float beta1, "
      "float beta2, float eps, float weight_decay) -> ()");
  // Private, for benchmarks/sweep_launch.py: the CUDA kernels' launch shape on every
  // device until _clear_launch_shape(), in place of csrc/cuda/launch_shape.cu's table.
  // items_per_thread: 2 or 4; blocks_per_sm: 1 to 32, capped at what an SM keeps resident.
  m.def("_set_launch_shape(int blocks_per_sm, int items_per_thread) -> ()");
  m.def("_clear_launch_shape() -> ()");
}
