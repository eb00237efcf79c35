// The scheduler behind shim/hetemu/runtime.h: one fiber per CUDA thread, switched by
// a few lines of x86-64 assembly (no system call per switch, unlike swapcontext: the
// kernels' block reductions switch ~2,000 times per chunk).
//
// A block's fibers run by strict priority in an order that the schedule fixes (in
// index order, reversed, or shuffled per block): the first ready fiber of that order
// runs until it waits at a barrier or a shuffle, or returns. A barrier or shuffle
// completes when its last thread arrives; the scheduler then starts again from the
// top of the order. A low-priority thread is thus held back as long as the others can
// go on, which is what makes a missing barrier show.
#include "hetemu/runtime.h"
#include "runtime_control.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#if !defined(__x86_64__) || !defined(__linux__)
#error "the emulator's fiber switch is written for x86-64 Linux"
#endif

// hetemu_switch(save, load): pushes the callee-saved registers and the SSE and x87
// control words, stores the stack pointer in *save, and resumes the context saved at
// `load` (the reverse of the same steps).
asm(R"(
  .text
  .p2align 4
  .type hetemu_switch, @function
hetemu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size hetemu_switch, .-hetemu_switch
)");
extern "C" void hetemu_switch(void** save, void* load);

namespace hetemu {

const dim3* g_thread_idx = nullptr;
dim3 g_block_idx, g_block_dim, g_grid_dim;

namespace {

constexpr std::size_t kStackBytes = 64 * 1024;
constexpr int kWarp = 32;

enum class State : unsigned char { kReady, kAtBarrier, kAtShuffle, kDone, kFailed };

struct Thread {
  dim3 idx;
  int linear = 0;
  void* sp = nullptr;
  char* stack_top = nullptr;
  State state = State::kReady;
  unsigned int mask = 0;         // of the shuffle it waits at
  unsigned int shuffles = 0;     // shuffles completed: which slot bank the next one uses
  const char* file = "";         // of the barrier or shuffle it waits at
  int line = 0;
};

// Stacks with an inaccessible page below each, so that an overflow faults instead of
// overwriting the next thread's stack.
class StackPool {
 public:
  char* top(std::size_t i) {
    while (i >= tops_.size()) {
      grow();
    }
    return tops_[i];
  }

 private:
  void grow() {
    const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    const std::size_t count = 256;
    const std::size_t bytes = count * (kStackBytes + page);
    void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) {
      throw std::runtime_error("hetemu: cannot map fiber stacks");
    }
    char* p = static_cast<char*>(base);
    for (std::size_t i = 0; i < count; ++i, p += kStackBytes + page) {
      mprotect(p, page, PROT_NONE);
      tops_.push_back(p + page + kStackBytes);
    }
  }

  std::vector<char*> tops_;
};

struct Block {
  std::vector<Thread> threads;
  std::vector<int> order;
  void (*body)(void*) = nullptr;
  void* context = nullptr;
  void* scheduler_sp = nullptr;
  Thread* running = nullptr;
  int at_barrier = 0;
  int done = 0;
  bool released = false;  // a barrier or shuffle completed: schedule from the top again
  const char* barrier_file = "";
  int barrier_line = 0;
  std::string error;
  // Two banks (alternate shuffles) of one 16-byte slot per thread.
  std::vector<unsigned char> slots[2];
};

Block g_block;
std::vector<std::pair<void*, std::size_t>> g_shared_arrays;
StackPool g_stacks;
std::mutex g_launch_mutex;
unsigned int g_schedule = 0;
long long g_launches = 0;
std::vector<LaunchRecord> g_recent_launches;

std::string block_name() {
  char text[64];
  std::snprintf(text, sizeof text, "block (%u,%u,%u)", g_block_idx.x, g_block_idx.y, g_block_idx.z);
  return text;
}

std::string where(const Thread& t) {
  char text[64];
  std::snprintf(text, sizeof text, "thread (%u,%u,%u) of ", t.idx.x, t.idx.y, t.idx.z);
  return text + block_name();
}

// "224 threads wait at __syncthreads (file:line); 26 at __shfl_down_sync (...); 6 exited"
std::string describe_waits() {
  std::vector<std::pair<std::string, int>> groups;
  for (const Thread& t : g_block.threads) {
    std::string what = t.state == State::kDone         ? "exited"
                       : t.state == State::kAtBarrier  ? "wait at __syncthreads"
                       : t.state == State::kAtShuffle  ? "wait at __shfl_down_sync"
                                                       : "are ready";
    if (t.state == State::kAtBarrier || t.state == State::kAtShuffle) {
      what += " (" + std::string(t.file) + ":" + std::to_string(t.line) + ")";
    }
    const auto found = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == what; });
    if (found == groups.end()) {
      groups.emplace_back(what, 1);
    } else {
      ++found->second;
    }
  }
  std::string s;
  for (const auto& [what, count] : groups) {
    s += (s.empty() ? ": " : "; ") + std::to_string(count) + " threads " + what;
  }
  return s;
}

void yield() {
  Thread* t = g_block.running;
  hetemu_switch(&t->sp, g_block.scheduler_sp);
}

[[noreturn]] void fail_thread(const std::string& what) {
  Thread* t = g_block.running;
  if (g_block.error.empty()) {
    g_block.error = where(*t) + ": " + what;
  }
  t->state = State::kFailed;
  yield();
  std::abort();  // a failed thread is never resumed
}

void thread_main() {
  try {
    g_block.body(g_block.context);
  } catch (const std::exception& e) {
    fail_thread(std::string("exception: ") + e.what());
  }
  Thread* t = g_block.running;
  t->state = State::kDone;
  ++g_block.done;
  yield();
  std::abort();
}

// A fresh context whose first switch-in enters thread_main at the top of its stack.
void* initial_sp(char* top) {
  unsigned int mxcsr = 0;
  unsigned short fpcw = 0;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpcw));
  void** sp = reinterpret_cast<void**>(reinterpret_cast<std::uintptr_t>(top) & ~std::uintptr_t{15});
  *--sp = nullptr;                                      // thread_main's return address: never used
  *--sp = reinterpret_cast<void*>(&thread_main);        // where the first switch "returns" to
  for (int i = 0; i < 6; ++i) {
    *--sp = nullptr;                                    // rbp, rbx, r12-r15
  }
  --sp;
  std::memcpy(sp, &mxcsr, 4);
  std::memcpy(reinterpret_cast<char*>(sp) + 4, &fpcw, 2);
  return sp;
}

// Releases the warp's lanes in `mask` if all of them wait at a shuffle with this mask.
void try_release_shuffle(const Thread& arrived) {
  const int warp_base = arrived.linear / kWarp * kWarp;
  const int n = static_cast<int>(g_block.threads.size());
  for (int lane = 0; lane < kWarp; ++lane) {
    if (arrived.mask & (1u << lane)) {
      if (warp_base + lane >= n) {
        return;  // a lane that does not exist: it never arrives (reported as a deadlock)
      }
      const Thread& t = g_block.threads[warp_base + lane];
      if (t.state != State::kAtShuffle || t.mask != arrived.mask || t.shuffles != arrived.shuffles) {
        return;
      }
    }
  }
  for (int lane = 0; lane < kWarp; ++lane) {
    if (arrived.mask & (1u << lane)) {
      g_block.threads[warp_base + lane].state = State::kReady;
    }
  }
  g_block.released = true;
}

void check_barrier_after_exit() {
  if (g_block.at_barrier > 0 && g_block.at_barrier + g_block.done == static_cast<int>(g_block.threads.size())) {
    throw std::runtime_error("hetemu: " + block_name() + ": " +
                             std::to_string(g_block.at_barrier) + " threads wait at __syncthreads (" +
                             g_block.barrier_file + ":" + std::to_string(g_block.barrier_line) + ") that " +
                             std::to_string(g_block.done) +
                             " threads of the block exited without reaching (a barrier in divergent code)");
  }
}

void run_block() {
  Block& b = g_block;
  for (Thread& t : b.threads) {
    t.sp = initial_sp(t.stack_top);
    t.state = State::kReady;
    t.shuffles = 0;
  }
  b.at_barrier = 0;
  b.done = 0;
  b.error.clear();
  for (const auto& [address, bytes] : g_shared_arrays) {
    std::memset(address, 0xFF, bytes);
  }

  const int n = static_cast<int>(b.threads.size());
  int cursor = 0;  // every thread before it in the order is waiting or done
  while (b.done < n) {
    while (cursor < n && b.threads[b.order[cursor]].state != State::kReady) {
      ++cursor;
    }
    if (cursor == n) {
      throw std::runtime_error("hetemu: deadlock in " + block_name() + describe_waits());
    }
    Thread& t = b.threads[b.order[cursor]];
    b.running = &t;
    g_thread_idx = &t.idx;
    b.released = false;
    hetemu_switch(&b.scheduler_sp, t.sp);
    if (t.state == State::kFailed) {
      throw std::runtime_error("hetemu: " + b.error);
    }
    if (t.state == State::kDone) {
      check_barrier_after_exit();
    }
    if (b.released) {
      cursor = 0;
    }
  }
}

}  // namespace

SharedArray::SharedArray(void* address, std::size_t bytes) {
  g_shared_arrays.emplace_back(address, bytes);
  std::memset(address, 0xFF, bytes);
}

void check_vector_access(const void* address, const char* access) {
  if (reinterpret_cast<std::uintptr_t>(address) % 16 != 0) {
    char text[128];
    std::snprintf(text, sizeof text, "misaligned address: 16-byte vector %s %p (not a multiple of 16)", access,
                  address);
    fail_thread(text);
  }
}

void syncthreads(const char* file, int line) {
  Block& b = g_block;
  Thread& t = *b.running;
  if (b.at_barrier == 0) {
    b.barrier_file = file;
    b.barrier_line = line;
  } else if (line != b.barrier_line || std::strcmp(file, b.barrier_file) != 0) {
    fail_thread("waits at __syncthreads (" + std::string(file) + ":" + std::to_string(line) +
                ") while other threads of the block wait at another (" + b.barrier_file + ":" +
                std::to_string(b.barrier_line) + ")");
  }
  t.state = State::kAtBarrier;
  t.file = file;
  t.line = line;
  ++b.at_barrier;
  const int n = static_cast<int>(b.threads.size());
  if (b.at_barrier + b.done == n) {
    if (b.done > 0) {
      fail_thread("reached __syncthreads after " + std::to_string(b.done) +
                  " threads of the block exited (a barrier in divergent code)");
    }
    for (Thread& other : b.threads) {
      other.state = State::kReady;
    }
    b.at_barrier = 0;
    b.released = true;
  }
  yield();
}

void shuffle_down(unsigned int mask, const void* value, void* out, std::size_t bytes, unsigned int delta, int width,
                  const char* file, int line) {
  Block& b = g_block;
  Thread& t = *b.running;
  const int lane = t.linear % kWarp;
  if (!(mask & (1u << lane))) {
    fail_thread("__shfl_down_sync with a mask that does not include the calling lane " + std::to_string(lane));
  }
  std::vector<unsigned char>& bank = b.slots[t.shuffles & 1];
  std::memcpy(bank.data() + static_cast<std::size_t>(t.linear) * 16, value, bytes);
  t.state = State::kAtShuffle;
  t.mask = mask;
  t.file = file;
  t.line = line;
  try_release_shuffle(t);
  yield();
  // PTX shfl.down: the source is lane + delta if that stays in the lane's segment of
  // `width` lanes; otherwise the thread keeps its own value.
  const int source = lane + static_cast<int>(delta);
  if (source < (lane / width + 1) * width) {
    if (!(mask & (1u << source))) {
      char text[128];
      std::snprintf(text, sizeof text, "__shfl_down_sync reads lane %d, which is not in its mask 0x%08x", source,
                    mask);
      fail_thread(text);
    }
    std::memcpy(out, bank.data() + static_cast<std::size_t>(t.linear - lane + source) * 16, bytes);
  } else {
    std::memcpy(out, value, bytes);
  }
  ++t.shuffles;
}

void run_grid(const LaunchConfig& config, void (*body)(void*), void* context) {
  const std::lock_guard<std::mutex> lock(g_launch_mutex);
  const dim3 grid = config.grid;
  const dim3 block = config.block;
  const unsigned long long threads = 1ull * block.x * block.y * block.z;
  if (threads == 0 || 1ull * grid.x * grid.y * grid.z == 0) {
    throw std::runtime_error(std::string("hetemu: ") + config.kernel_name +
                             " launched with an empty grid or block (invalid configuration argument)");
  }
  if (threads > 1024) {
    throw std::runtime_error(std::string("hetemu: ") + config.kernel_name + " launched with " +
                             std::to_string(threads) + " threads per block; at most 1024");
  }
  ++g_launches;
  if (g_recent_launches.size() == static_cast<std::size_t>(kMaxRecentLaunches)) {
    g_recent_launches.erase(g_recent_launches.begin());
  }
  g_recent_launches.push_back({1ll * grid.x * grid.y * grid.z, static_cast<long long>(threads),
                               reinterpret_cast<std::uintptr_t>(config.kernel)});

  Block& b = g_block;
  const int n = static_cast<int>(threads);
  b.threads.assign(n, Thread{});
  for (int i = 0; i < n; ++i) {
    Thread& t = b.threads[i];
    t.linear = i;
    t.idx = dim3(i % block.x, i / block.x % block.y, i / (block.x * block.y));
    t.stack_top = g_stacks.top(i);
  }
  for (auto& bank : b.slots) {
    bank.assign(static_cast<std::size_t>(n) * 16, 0);
  }
  b.body = body;
  b.context = context;
  g_block_dim = block;
  g_grid_dim = grid;

  std::vector<dim3> blocks;
  for (unsigned int z = 0; z < grid.z; ++z) {
    for (unsigned int y = 0; y < grid.y; ++y) {
      for (unsigned int x = 0; x < grid.x; ++x) {
        blocks.emplace_back(x, y, z);
      }
    }
  }
  b.order.resize(n);
  std::iota(b.order.begin(), b.order.end(), 0);
  std::mt19937 rng(g_schedule);
  if (g_schedule == kReversed) {
    std::reverse(blocks.begin(), blocks.end());
    std::reverse(b.order.begin(), b.order.end());
  } else if (g_schedule >= kShuffledFirstSeed) {
    std::shuffle(blocks.begin(), blocks.end(), rng);
  }
  for (const dim3& idx : blocks) {
    g_block_idx = idx;
    if (g_schedule >= kShuffledFirstSeed) {
      std::shuffle(b.order.begin(), b.order.end(), rng);
    }
    run_block();
  }
  check_guards(config.kernel_name);
}

void set_schedule(unsigned int schedule) {
  g_schedule = schedule;
}

long long launch_count() {
  return g_launches;
}

std::vector<LaunchRecord> take_recent_launches() {
  const std::lock_guard<std::mutex> lock(g_launch_mutex);
  return std::exchange(g_recent_launches, {});
}

}  // namespace hetemu
