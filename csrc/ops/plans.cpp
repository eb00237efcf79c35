#include "ops/plans.h"

#include "ops/checks.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

namespace hetcomm {
namespace {

int64_t total_numel(at::TensorList list) {
  int64_t total = 0;
  for (const at::Tensor& t : list) {
    total += t.numel();
  }
  return total;
}

void check_flat_buffer(const char* op, const char* name, const at::Tensor& flat, const c10::Device& device,
                       int64_t expected_numel, const char* list_name) {
  check_float_tensor(op, name, flat, device);
  TORCH_CHECK(flat.dim() == 1, "hetcomm.", op, ": ", name, " must be 1-D; got shape ", flat.sizes());
  TORCH_CHECK(flat.numel() == expected_numel, "hetcomm.", op, ": ", name, " has ", flat.numel(),
              " elements but the tensors of ", list_name, " hold ", expected_numel,
              " in all; expected exactly that many");
}

}  // namespace

int64_t check_pack_sources(at::TensorList src, const at::Tensor& scale) {
  const c10::Device device = list_device("pack", "src", src);
  check_float_list("pack", "src", src, device);
  check_scalar_tensor("pack", "scale", scale, device);
  return total_numel(src);
}

at::Tensor empty_pack_output(at::TensorList src, const at::Tensor& scale, c10::ScalarType dtype) {
  const int64_t total = check_pack_sources(src, scale);
  check_supported_dtype("pack", "dtype", dtype);
  return at::empty({total}, src[0].options().dtype(dtype));
}

SegmentList plan_pack(at::TensorList src, const at::Tensor& scale, const at::Tensor& out) {
  const int64_t total = check_pack_sources(src, scale);
  check_flat_buffer("pack", "out", out, src[0].device(), total, "src");

  std::vector<Region> regions{{"scale", &scale, false}, {"out", &out, true}};
  add_regions(regions, "src", src, false);
  check_no_overlap("pack", regions);

  SegmentList segments;
  segments.reserve(src.size());
  char* cursor = static_cast<char*>(out.data_ptr());
  for (const at::Tensor& t : src) {
    segments.push_back({t.const_data_ptr(), cursor, t.numel(), t.scalar_type(), out.scalar_type()});
    cursor += t.numel() * out.element_size();
  }
  return segments;
}

SegmentList plan_unpack(const at::Tensor& flat, at::TensorList dst, const at::Tensor& scale,
                        const at::Tensor& found_inf, const std::optional<at::Tensor>& sq_norm) {
  TORCH_CHECK(flat.defined(), "hetcomm.unpack_: flat is an undefined tensor");
  const c10::Device device = flat.device();
  check_float_list("unpack_", "dst", dst, device);
  check_flat_buffer("unpack_", "flat", flat, device, total_numel(dst), "dst");
  check_scalar_tensor("unpack_", "scale", scale, device);
  check_scalar_tensor("unpack_", "found_inf", found_inf, device);
  std::vector<Region> regions{{"flat", &flat, false}, {"scale", &scale, false}, {"found_inf", &found_inf, true}};
  if (sq_norm.has_value()) {
    check_scalar_tensor("unpack_", "sq_norm", *sq_norm, device);
    regions.push_back({"sq_norm", &*sq_norm, true});
  }
  add_regions(regions, "dst", dst, true);
  check_no_overlap("unpack_", regions);

  SegmentList segments;
  segments.reserve(dst.size());
  const char* cursor = static_cast<const char*>(flat.const_data_ptr());
  for (const at::Tensor& t : dst) {
    segments.push_back({cursor, t.data_ptr(), t.numel(), flat.scalar_type(), t.scalar_type()});
    cursor += t.numel() * flat.element_size();
  }
  return segments;
}

SegmentList plan_unscale(at::TensorList tensors, const at::Tensor& inv_scale, const at::Tensor& found_inf) {
  const c10::Device device = list_device("unscale_", "tensors", tensors);
  check_float_list("unscale_", "tensors", tensors, device);
  check_scalar_tensor("unscale_", "inv_scale", inv_scale, device);
  check_scalar_tensor("unscale_", "found_inf", found_inf, device);
  std::vector<Region> regions{{"inv_scale", &inv_scale, false}, {"found_inf", &found_inf, true}};
  add_regions(regions, "tensors", tensors, true);
  check_no_overlap("unscale_", regions);

  SegmentList segments;
  segments.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    segments.push_back({t.const_data_ptr(), t.data_ptr(), t.numel(), t.scalar_type(), t.scalar_type()});
  }
  return segments;
}

SegmentList plan_cast(at::TensorList src, at::TensorList dst) {
  const c10::Device device = list_device("cast_", "src", src);
  check_float_list("cast_", "src", src, device);
  check_float_list("cast_", "dst", dst, device);
  TORCH_CHECK(src.size() == dst.size(), "hetcomm.cast_: src has ", src.size(), " tensors but dst has ",
              dst.size(), "; expected lists of equal length");
  for (size_t i = 0; i < src.size(); ++i) {
    TORCH_CHECK(src[i].sizes() == dst[i].sizes(), "hetcomm.cast_: src[", i, "] has shape ", src[i].sizes(),
                " but dst[", i, "] has shape ", dst[i].sizes(), "; expected equal shapes");
  }
  std::vector<Region> regions;
  add_regions(regions, "src", src, false);
  add_regions(regions, "dst", dst, true);
  check_no_overlap("cast_", regions);

  SegmentList segments;
  segments.reserve(src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    segments.push_back({src[i].const_data_ptr(), dst[i].data_ptr(), src[i].numel(), src[i].scalar_type(),
                        dst[i].scalar_type()});
  }
  return segments;
}

}  // namespace hetcomm
