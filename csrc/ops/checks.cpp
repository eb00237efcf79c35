#include "ops/checks.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

namespace hetcomm {

std::string dtype_name(c10::ScalarType type) {
  return "torch." + std::string(c10::getDtypeNames(type).first);
}

bool is_supported_float(c10::ScalarType type) {
  return type == c10::ScalarType::Float || type == c10::ScalarType::Half ||
         type == c10::ScalarType::BFloat16;
}

void check_supported_dtype(const char* op, const char* name, c10::ScalarType type) {
  TORCH_CHECK_TYPE(is_supported_float(type), "hetcomm.", op, ": ", name, " has dtype ", dtype_name(type),
                   "; expected torch.float32, torch.float16 or torch.bfloat16");
}

void check_float_tensor(const char* op, const std::string& name, const at::Tensor& t,
                        const c10::Device& device) {
  TORCH_CHECK(t.defined(), "hetcomm.", op, ": ", name, " is an undefined tensor");
  check_supported_dtype(op, name.c_str(), t.scalar_type());
  TORCH_CHECK(t.device() == device, "hetcomm.", op, ": ", name, " is on ", t.device(),
              " but the other tensors are on ", device, "; all tensors of one call must be on one device");
  TORCH_CHECK(t.is_contiguous(), "hetcomm.", op, ": ", name, " is not contiguous (sizes ", t.sizes(),
              ", strides ", t.strides(), "); pass t.contiguous() or a contiguous buffer");
}

c10::Device list_device(const char* op, const char* name, at::TensorList list) {
  TORCH_CHECK(!list.empty(), "hetcomm.", op, ": ", name, " is an empty list; expected at least one tensor");
  TORCH_CHECK(list[0].defined(), "hetcomm.", op, ": ", name, "[0] is an undefined tensor");
  return list[0].device();
}

void check_float_list(const char* op, const char* name, at::TensorList list, const c10::Device& device) {
  TORCH_CHECK(!list.empty(), "hetcomm.", op, ": ", name, " is an empty list; expected at least one tensor");
  for (size_t i = 0; i < list.size(); ++i) {
    check_float_tensor(op, std::string(name) + "[" + std::to_string(i) + "]", list[i], device);
  }
}

void check_scalar_tensor(const char* op, const char* name, const at::Tensor& t, const c10::Device& device) {
  TORCH_CHECK(t.defined(), "hetcomm.", op, ": ", name, " is an undefined tensor");
  TORCH_CHECK(t.numel() == 1 && t.scalar_type() == c10::ScalarType::Float,
              "hetcomm.", op, ": ", name, " must be a 1-element torch.float32 tensor; got shape ", t.sizes(),
              " and dtype ", dtype_name(t.scalar_type()));
  TORCH_CHECK(t.device() == device, "hetcomm.", op, ": ", name, " is on ", t.device(),
              " but the data is on ", device, "; keep it on the data's device (no host round trip)");
}

void add_regions(std::vector<Region>& regions, const char* name, at::TensorList list, bool written) {
  for (size_t i = 0; i < list.size(); ++i) {
    regions.push_back({std::string(name) + "[" + std::to_string(i) + "]", &list[i], written});
  }
}

void check_no_overlap(const char* op, const std::vector<Region>& regions) {
  struct Span {
    uintptr_t begin;
    uintptr_t end;
    size_t region;
  };
  std::vector<Span> spans;
  spans.reserve(regions.size());
  for (size_t i = 0; i < regions.size(); ++i) {
    const at::Tensor& t = *regions[i].tensor;
    if (t.numel() == 0) {
      continue;
    }
    // Every tensor here is contiguous (checked before), so its bytes form one interval.
    const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    spans.push_back({begin, begin + static_cast<uintptr_t>(t.numel()) * t.element_size(), i});
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });

  // Sweep in address order, remembering the earlier interval that reaches furthest,
  // among all and among the written ones: any overlap involving a written tensor
  // shows up against one of those two.
  const Span* furthest = nullptr;
  const Span* furthest_written = nullptr;
  for (const Span& s : spans) {
    const Span* clash = nullptr;
    if (furthest_written != nullptr && s.begin < furthest_written->end) {
      clash = furthest_written;
    } else if (regions[s.region].written && furthest != nullptr && s.begin < furthest->end) {
      clash = furthest;
    }
    TORCH_CHECK(clash == nullptr, "hetcomm.", op, ": ", regions[clash->region].name, " and ",
                regions[s.region].name, " share memory, and at least one of them is written; ",
                "pass tensors that do not alias");
    if (furthest == nullptr || s.end > furthest->end) {
      furthest = &s;
    }
    if (regions[s.region].written && (furthest_written == nullptr || s.end > furthest_written->end)) {
      furthest_written = &s;
    }
  }
}

}  // namespace hetcomm
