// What the module (src/module.cpp) sets and reads of the runtime (src/runtime.cpp).
#pragma once

#include <vector>

namespace hetemu {

// Schedules: threads (and blocks) in index order, in reverse, or shuffled with the
// schedule as the seed of the shuffle.
constexpr unsigned int kInOrder = 0;
constexpr unsigned int kReversed = 1;
constexpr unsigned int kShuffledFirstSeed = 2;

void set_schedule(unsigned int schedule);

// Kernel launches since the library was loaded.
long long launch_count();

struct LaunchRecord {
  long long grid;   // blocks
  long long block;  // threads per block
  unsigned long long kernel;
};

// The launches since the previous call (the last kMaxRecentLaunches of them, oldest
// first), which it forgets.
constexpr int kMaxRecentLaunches = 64;
std::vector<LaunchRecord> take_recent_launches();

// On: CPU tensors get guard bytes after their end (src/guarded_allocator.cpp).
void guard_allocations(bool on);

// Throws if a guard byte of a live allocation was overwritten (after each launch).
void check_guards(const char* kernel);

}  // namespace hetemu
