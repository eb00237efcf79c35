// Segment tables in device memory for lists of tensors that recur. A training run
// passes the same gradients and parameters to the same op every step; a list too long
// for one launch's argument table (kernels::kMaxSegments segments of a dtype pair,
// kMaxAdamWSegments for adamw_) takes one launch per 160 (80) segments from kernel
// arguments, but one per dtype pair from a table in device memory. Such a table is
// uploaded the second time its list comes (the first call runs from kernel arguments,
// so a list that never recurs costs no upload), and reused while the list keeps
// coming; an LRU of kMaxTables entries bounds what is kept.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

namespace hetcomm::cuda {

// What a table is found by. `words` is the table itself, column by column as the
// kernel reads it, built on the host at every call (which costs what filling the
// argument tables does); a hit is therefore always the table a rebuild would upload.
// Per row (a tensor, or a 2^30-element piece of one) it holds the tensor's addresses
// (data_ptr: the storage's address plus the offset, so a tensor replaced by one
// elsewhere changes the key) and its element count (so does a tensor reallocated at the
// same address with another size). `groups` holds each dtype pair's types and rows (so
// does a recast tensor). The ops take contiguous tensors only, so an address and a count
// describe a tensor's memory exactly; tensor versions (in-place writes) change data, not
// tables. A tensor freed and another allocated at the same address with the same count
// and dtype makes the same key, and the same table is right for it. `op` keeps one op's
// first call of a list a first call, whatever another op did with the same tensors.
// `device` is where the table lives; `stream`, the stream that uploaded it and the only
// one that reads it, so that no kernel reads a table before its upload and the caching
// allocator reuses an evicted table's memory only after the kernels that read it.
struct TableKey {
  int op;
  c10::Device device;
  cudaStream_t stream;
  std::vector<int64_t> groups;
  std::vector<int64_t> words;

  bool operator==(const TableKey&) const = default;
};

// The table of `key` in device memory; an undefined tensor on the first call of a
// list, which then runs from kernel arguments (the key is remembered, and the list's
// next call uploads the table on `stream`, the current stream of `device`).
at::Tensor find_device_table(TableKey key);

// Whether `stream` is capturing a CUDA graph. Captured work runs from kernel
// arguments: a graph would keep reading a table's address after the cache freed it,
// and a first call's upload would be captured with it.
bool capturing(cudaStream_t stream);

struct TableCacheStats {
  int64_t hits;           // calls that ran from a device table (the first of them uploaded it)
  int64_t misses;         // first calls of a list: ran from kernel arguments
  int64_t uploads;        // tables built and copied to a device
  int64_t entries;        // lists held now (with or without a table yet)
  int64_t last_launches;  // of the last call's multi-tensor or adamw_ walk (not its sum of squares)
};

TableCacheStats table_cache_stats();

// Drops every table and zeroes the counters.
void clear_table_cache();

// The walks (cuda/multi_tensor_cuda, cuda/adamw_cuda) report their launches here.
void record_launches(int64_t launches);

}  // namespace hetcomm::cuda
