// The CPU back end's parallel walk over a list of segments seen as one flat index
// space: fixed-size chunks, each cut at segment boundaries into pieces, so that the
// work splits evenly whatever the sizes of the tensors.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace hetcomm::cpu {

// Elements per unit of parallel work: large enough that the per-chunk bookkeeping
// (a binary search, a function-pointer call per segment piece) is noise, small enough
// that 4M elements still give every core several chunks.
constexpr int64_t kChunk = 1 << 15;

// offsets[k] is where segment k starts in the flat index space, offsets.back() the
// total. Calls piece(chunk, k, local, n) for elements [local, local + n) of segment k,
// every element exactly once, chunks in parallel; returns the number of chunks.
template <typename Piece>
int64_t for_each_piece(const std::vector<int64_t>& offsets, const Piece& piece) {
  const size_t count = offsets.size() - 1;
  const int64_t total = offsets[count];
  const int64_t num_chunks = (total + kChunk - 1) / kChunk;
  at::parallel_for(0, num_chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
      const int64_t begin = chunk * kChunk;
      const int64_t end = std::min(total, begin + kChunk);
      // The segment holding `begin`: the last one starting at or before it (empty
      // segments share their start with the next one and are skipped by upper_bound).
      size_t k = std::upper_bound(offsets.begin(), offsets.begin() + count, begin) - offsets.begin() - 1;
      for (int64_t pos = begin; pos < end; ++k) {
        const int64_t stop = std::min(end, offsets[k + 1]);
        if (stop > pos) {
          piece(chunk, k, pos - offsets[k], stop - pos);
        }
        pos = stop;
      }
    }
  });
  return num_chunks;
}

}  // namespace hetcomm::cpu
