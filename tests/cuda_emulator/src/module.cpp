// The C interface of one emulated-GPU library, for ctypes (cuda_emulator/gpu.py).
// Nothing is registered at load: enable() binds the CUDA back end's kernels (the block
// of csrc/cuda/ops_cuda.cu) to CPU tensors of the hetcomm ops, in front of the CPU
// back end's kernels, binds the back end's settings (_set_launch_shape, ...) to this
// library's copy of it, and puts guard bytes after every CPU tensor allocated
// meanwhile; disable() removes all three again.
#include "cuda/device_tables.h"
#include "cuda/launch_shape.h"
#include "runtime_control.h"

#include <torch/library.h>

#include <algorithm>
#include <exception>
#include <iterator>
#include <memory>
#include <string>

namespace hetcomm::cuda {
void register_emulated_kernels(torch::Library& m);
void register_emulated_settings(torch::Library& m);
}

namespace {

std::unique_ptr<torch::Library> g_library;
std::unique_ptr<torch::Library> g_settings;
std::string g_error;

}  // namespace

#define HETEMU_EXPORT extern "C" __attribute__((visibility("default")))

// Returns null, or what went wrong. The launch shape starts from the table, as in a new
// process: an override left by an earlier user of this library must not shape a test.
HETEMU_EXPORT const char* hetemu_enable() {
  try {
    g_library.reset();
    g_settings.reset();
    hetcomm::cuda::clear_launch_shape_override();
    g_library = std::make_unique<torch::Library>(torch::Library::IMPL, "hetcomm", c10::DispatchKey::CPU, __FILE__,
                                                 __LINE__);
    hetcomm::cuda::register_emulated_kernels(*g_library);
    g_settings = std::make_unique<torch::Library>(torch::Library::IMPL, "hetcomm",
                                                  c10::DispatchKey::CompositeExplicitAutograd, __FILE__, __LINE__);
    hetcomm::cuda::register_emulated_settings(*g_settings);
    hetemu::guard_allocations(true);
    return nullptr;
  } catch (const std::exception& e) {
    g_library.reset();
    g_settings.reset();
    g_error = e.what();
    return g_error.c_str();
  }
}

HETEMU_EXPORT void hetemu_disable() {
  g_library.reset();
  g_settings.reset();
  hetemu::guard_allocations(false);
}

HETEMU_EXPORT void hetemu_set_schedule(unsigned int schedule) {
  hetemu::set_schedule(schedule);
}

HETEMU_EXPORT long long hetemu_launches() {
  return hetemu::launch_count();
}

// The launches since the previous call, oldest first: grid, block size and the kernel's
// address (which tells the instances of one kernel template apart) of each, into `out`
// (room for kMaxRecentLaunches triples). Returns how many.
HETEMU_EXPORT int hetemu_take_recent_launches(long long* out) {
  const std::vector<hetemu::LaunchRecord> launches = hetemu::take_recent_launches();
  for (const hetemu::LaunchRecord& launch : launches) {
    *out++ = launch.grid;
    *out++ = launch.block;
    *out++ = static_cast<long long>(launch.kernel);
  }
  return static_cast<int>(launches.size());
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
