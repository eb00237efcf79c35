// The C interface of one emulated-GPU library, for ctypes (cuda_emulator/gpu.py).
// Nothing is registered at load: enable() binds the CUDA back end's kernels (the block
// of csrc/cuda/ops_cuda.cu) to CPU tensors of the hetcomm ops, in front of the CPU
// back end's kernels, and puts guard bytes after every CPU tensor allocated meanwhile;
// disable() removes both again.
#include "cuda/device_tables.h"
#include "runtime_control.h"

#include <torch/library.h>

#include <algorithm>
#include <exception>
#include <iterator>
#include <memory>
#include <string>

namespace hetcomm::cuda {
void register_emulated_kernels(torch::Library& m);
}

namespace {

std::unique_ptr<torch::Library> g_library;
std::string g_error;

}  // namespace

#define HETEMU_EXPORT extern "C" __attribute__((visibility("default")))

// Returns null, or what went wrong.
HETEMU_EXPORT const char* hetemu_enable() {
  try {
    g_library.reset();
    g_library = std::make_unique<torch::Library>(torch::Library::IMPL, "hetcomm", c10::DispatchKey::CPU, __FILE__,
                                                 __LINE__);
    hetcomm::cuda::register_emulated_kernels(*g_library);
    hetemu::guard_allocations(true);
    return nullptr;
  } catch (const std::exception& e) {
    g_library.reset();
    g_error = e.what();
    return g_error.c_str();
  }
}

HETEMU_EXPORT void hetemu_disable() {
  g_library.reset();
  hetemu::guard_allocations(false);
}

HETEMU_EXPORT void hetemu_set_schedule(unsigned int schedule) {
  hetemu::set_schedule(schedule);
}

HETEMU_EXPORT long long hetemu_launches() {
  return hetemu::launch_count();
}

// hits, misses, uploads, entries, launches of the last call (cuda/device_tables.h).
HETEMU_EXPORT void hetemu_table_cache_stats(long long* out) {
  const hetcomm::cuda::TableCacheStats stats = hetcomm::cuda::table_cache_stats();
  const long long values[] = {stats.hits, stats.misses, stats.uploads, stats.entries, stats.last_launches};
  std::copy(std::begin(values), std::end(values), out);
}

HETEMU_EXPORT void hetemu_clear_table_cache() {
  hetcomm::cuda::clear_table_cache();
}
