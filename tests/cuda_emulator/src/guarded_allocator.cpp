// While an emulated GPU is switched on, CPU tensors are allocated with 64 guard bytes
// after their end, and every launch ends by checking the guard bytes of every live
// allocation: a kernel that writes past the end of a tensor fails its launch with a
// report (on a GPU: an illegal address, or silent corruption of a neighbour) instead of
// corrupting the heap. Allocations keep torch's 64-byte alignment, so the kernels take
// the same aligned and misaligned paths as with torch's own allocator.
#include "runtime_control.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace hetemu {
namespace {

constexpr std::size_t kGuardBytes = 64;
constexpr unsigned char kGuard = 0xA5;

std::mutex g_mutex;
std::unordered_map<void*, std::size_t> g_live;  // allocation -> bytes asked for

bool guard_intact(const void* p, std::size_t bytes) {
  const unsigned char* guard = static_cast<const unsigned char*>(p) + bytes;
  for (std::size_t i = 0; i < kGuardBytes; ++i) {
    if (guard[i] != kGuard) {
      return false;
    }
  }
  return true;
}

void release(void* p) {
  {
    const std::lock_guard<std::mutex> lock(g_mutex);
    g_live.erase(p);
  }
  c10::free_cpu(p);
}

class GuardedAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(std::size_t bytes) override {
    void* p = c10::alloc_cpu(bytes + kGuardBytes);
    std::memset(static_cast<char*>(p) + bytes, kGuard, kGuardBytes);
    {
      const std::lock_guard<std::mutex> lock(g_mutex);
      g_live.emplace(p, bytes);
    }
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

GuardedAllocator g_allocator;
c10::Allocator* g_previous = nullptr;

}  // namespace

void guard_allocations(bool on) {
  if (on && g_previous == nullptr) {
    g_previous = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&g_allocator);
  } else if (!on && g_previous != nullptr) {
    c10::SetCPUAllocator(g_previous);
    g_previous = nullptr;
  }
}

void check_guards(const char* kernel) {
  const std::lock_guard<std::mutex> lock(g_mutex);
  for (const auto& [p, bytes] : g_live) {
    if (!guard_intact(p, bytes)) {
      std::memset(static_cast<char*>(p) + bytes, kGuard, kGuardBytes);  // report it once
      throw std::runtime_error(std::string("hetemu: ") + kernel + " wrote past the end of a " +
                               std::to_string(bytes) + "-byte allocation (an out-of-bounds store)");
    }
  }
}

}  // namespace hetemu
