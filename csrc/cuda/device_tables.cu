#include "cuda/device_tables.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <cstring>
#include <list>
#include <mutex>

namespace hetcomm::cuda {
namespace {

// Lists with or without a table yet. The long lists of a training step are few (the
// unscale_ of every gradient, adamw_ over every parameter, the cast_ of the masters,
// a bucket of many small tensors); reducer buckets of up to kMaxSegments tensors per
// dtype pair run in one launch from arguments and never come here.
constexpr size_t kMaxTables = 16;
// The sum of the keys' words (each held on the host, and once uploaded on a device
// too): 32 MiB, the rows of 1.4M tensors. The newest entry stays whatever its size.
constexpr size_t kMaxWords = size_t{1} << 22;

uint64_t mix(uint64_t hash, uint64_t value) {
  hash ^= value + 0x9E3779B97F4A7C15ull + (hash << 6) + (hash >> 2);
  return hash;
}

uint64_t hash_of(const TableKey& key) {
  uint64_t hash = mix(mix(mix(0, static_cast<uint64_t>(key.op)), static_cast<uint64_t>(key.device.index())),
                      reinterpret_cast<uintptr_t>(key.stream));
  for (const int64_t g : key.groups) {
    hash = mix(hash, static_cast<uint64_t>(g));
  }
  for (const int64_t w : key.words) {
    hash = mix(hash, static_cast<uint64_t>(w));
  }
  return hash;
}

// Copies the words to the key's device on its stream (the current one), from pinned
// memory so that the copy is asynchronous; torch's host allocator keeps the pinned
// buffer until the copy is done. On a CPU device (tests/cuda_emulator runs these
// kernels on CPU tensors) the host table is the device table.
at::Tensor upload(const TableKey& key) {
  const int64_t n = static_cast<int64_t>(key.words.size());
  at::Tensor host = at::empty({n}, at::TensorOptions().dtype(at::kLong).pinned_memory(key.device.is_cuda()));
  std::memcpy(host.mutable_data_ptr<int64_t>(), key.words.data(), key.words.size() * sizeof(int64_t));
  if (!key.device.is_cuda()) {
    return host;
  }
  // The copy goes on the current stream: it must be the key's, the one stream that
  // reads the table, or a kernel could read it before it lands.
  TORCH_INTERNAL_ASSERT(c10::cuda::getCurrentCUDAStream(key.device.index()).stream() == key.stream,
                        "hetcomm: a device table uploaded on another stream than the one that reads it");
  return host.to(key.device, /*non_blocking=*/true);
}

struct Entry {
  TableKey key;
  uint64_t hash;
  at::Tensor table;  // undefined until the list's second call
};

class TableCache {
 public:
  at::Tensor find(TableKey key) {
    const uint64_t hash = hash_of(key);
    const std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->hash == hash && it->key == key) {
        entries_.splice(entries_.begin(), entries_, it);  // the most recent first
        if (!it->table.defined()) {
          it->table = upload(it->key);
          ++uploads_;
        }
        ++hits_;
        return it->table;
      }
    }
    ++misses_;
    words_ += key.words.size();
    entries_.push_front({std::move(key), hash, at::Tensor()});
    while (entries_.size() > kMaxTables || (words_ > kMaxWords && entries_.size() > 1)) {
      words_ -= entries_.back().key.words.size();
      entries_.pop_back();
    }
    return at::Tensor();
  }

  TableCacheStats stats() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return {hits_, misses_, uploads_, static_cast<int64_t>(entries_.size()), last_launches_.load()};
  }

  void clear() {
    const std::lock_guard<std::mutex> lock(mutex_);
    entries_.clear();
    words_ = 0;
    hits_ = misses_ = uploads_ = 0;
    last_launches_ = 0;
  }

  void record_launches(int64_t launches) { last_launches_ = launches; }

 private:
  std::mutex mutex_;  // ops may run on several threads (one per device, say)
  std::list<Entry> entries_;
  size_t words_ = 0;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
  int64_t uploads_ = 0;
  std::atomic<int64_t> last_launches_{0};
};

// Never destroyed: its tables would otherwise go back to the CUDA caching allocator
// during static destruction at exit, after the allocator or the driver may be gone.
TableCache& cache() {
  static TableCache* const instance = new TableCache();
  return *instance;
}

}  // namespace

at::Tensor find_device_table(TableKey key) {
  return cache().find(std::move(key));
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

TableCacheStats table_cache_stats() {
  return cache().stats();
}

void clear_table_cache() {
  cache().clear();
}

void record_launches(int64_t launches) {
  cache().record_launches(launches);
}

}  // namespace hetcomm::cuda
