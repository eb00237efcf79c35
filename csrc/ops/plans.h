// Each op validated and turned into a segment list, independent of the device that
// will run it. A plan function either throws (nothing written yet) or returns the
// complete list of work.
#pragma once

#include "ops/segment.h"

#include <ATen/core/Tensor.h>

#include <optional>

namespace hetcomm {

// Validates pack's sources and scale; returns the total element count.
int64_t check_pack_sources(at::TensorList src, const at::Tensor& scale);

// Validates pack's sources, scale and wire dtype; returns the uninitialised 1-D output.
at::Tensor empty_pack_output(at::TensorList src, const at::Tensor& scale, c10::ScalarType dtype);

// out = concat(src[k].flatten() * scale) cast to out's dtype.
SegmentList plan_pack(at::TensorList src, const at::Tensor& scale, const at::Tensor& out);

// dst[k] = cast(flat[segment k] * scale), segments laid out in list order.
SegmentList plan_unpack(const at::Tensor& flat, at::TensorList dst, const at::Tensor& scale,
                        const at::Tensor& found_inf, const std::optional<at::Tensor>& sq_norm);

// tensors[k] = cast(tensors[k] * inv_scale), in place.
SegmentList plan_unscale(at::TensorList tensors, const at::Tensor& inv_scale, const at::Tensor& found_inf);

// dst[k] = cast(src[k]).
SegmentList plan_cast(at::TensorList src, at::TensorList dst);

}  // namespace hetcomm
