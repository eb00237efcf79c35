// What CUDA kernel source needs to compile with g++ and run on the CPU: the CUDA
// keywords, threadIdx/blockIdx/blockDim/gridDim, __syncthreads, __shfl_down_sync, the
// 16-byte vector type, and the launch. Every CUDA thread of a block is a fiber of the
// launching OS thread (src/runtime.cpp schedules them); blocks run one after another.
//
// Besides running the code, it reports what a GPU would fault on or leave undefined,
// naming the thread and block: a 16-byte vector access at an address that is not a
// multiple of 16, a __syncthreads that not every thread of the block reaches (or
// reaches at different calls), a warp shuffle that reads a lane outside its mask, and
// deadlock. Shared memory is filled with 0xFF bytes (NaN as float or double) at the
// start of every block, so reading it before writing it shows.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>

#include <cuda_runtime_api.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
// Blocks run one at a time, so a static is exactly one block's shared memory; the
// registration lets the runtime fill it with 0xFF bytes at every block start.
#define HETCOMM_SHARED(type, name, dims) \
  static type name dims;                 \
  static const ::hetemu::SharedArray name##_hetemu_shared(name, sizeof(name))
#define __shared__ \
  static_assert(false, "declare shared memory with HETCOMM_SHARED (csrc/kernels/shared_memory.cuh)");

namespace hetemu {

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

// The built-in variables of the running thread and block (set by the runtime).
extern const dim3* g_thread_idx;
extern dim3 g_block_idx, g_block_dim, g_grid_dim;

// Fails the thread unless address is a multiple of 16 (access: "load from", "store to").
void check_vector_access(const void* address, const char* access);

void syncthreads(const char* file, int line);

// Registers a shared array (and fills it) the first time its declaration runs.
struct SharedArray {
  SharedArray(void* address, std::size_t bytes);
};

// The lanes of `mask` exchange `bytes` bytes (at most 16): `out` receives the value of
// lane + delta within the lane's width-wide segment, or `value` when that is outside.
void shuffle_down(unsigned int mask, const void* value, void* out, std::size_t bytes, unsigned int delta, int width,
                  const char* file, int line);

template <typename T>
T shfl_down_sync(unsigned int mask, T value, unsigned int delta, int width, const char* file, int line) {
  static_assert(sizeof(T) <= 16, "a shuffle moves at most 16 bytes here");
  T out;
  shuffle_down(mask, &value, &out, sizeof(T), delta, width, file, line);
  return out;
}

struct LaunchConfig {
  dim3 grid, block;
  const char* kernel_name;  // as launched, with the file and line of the launch
  const void* kernel;       // which instance of a kernel template ran (src/module.cpp reports it)
};

// Runs body(context) as every thread of every block of the grid; throws
// std::runtime_error naming the thread and block when one of them fails.
void run_grid(const LaunchConfig& config, void (*body)(void*), void* context);

// HETCOMM_LAUNCH(kernel, grid, block, shared_bytes, stream)(args...): each thread calls
// the kernel with its own copy of the arguments, converted to the parameter types.
template <typename... Params>
class Launch {
 public:
  Launch(void (*kernel)(Params...), dim3 grid, dim3 block, const char* name)
      : kernel_(kernel), config_{grid, block, name, reinterpret_cast<const void*>(kernel)} {}

  template <typename... Args>
  void operator()(Args&&... args) const {
    struct Call {
      void (*kernel)(Params...);
      std::tuple<std::decay_t<Params>...> params;
    } call{kernel_, {static_cast<std::decay_t<Params>>(std::forward<Args>(args))...}};
    run_grid(
        config_, [](void* p) { std::apply(static_cast<Call*>(p)->kernel, static_cast<Call*>(p)->params); }, &call);
  }

 private:
  void (*kernel_)(Params...);
  LaunchConfig config_;
};

}  // namespace hetemu

#define HETEMU_STRING(x) #x
#define HETEMU_LINE(x) HETEMU_STRING(x)
#define HETCOMM_LAUNCH(kernel, grid, block, shared_bytes, stream)              \
  ::hetemu::Launch(kernel, ::hetemu::dim3(grid), ::hetemu::dim3(block), \
                   #kernel " (" __FILE__ ":" HETEMU_LINE(__LINE__) ")")

#define threadIdx (static_cast<const ::hetemu::dim3&>(*::hetemu::g_thread_idx))
#define blockIdx (static_cast<const ::hetemu::dim3&>(::hetemu::g_block_idx))
#define blockDim (static_cast<const ::hetemu::dim3&>(::hetemu::g_block_dim))
#define gridDim (static_cast<const ::hetemu::dim3&>(::hetemu::g_grid_dim))
#define warpSize 32
#define __syncthreads() ::hetemu::syncthreads(__FILE__, __LINE__)
#define __shfl_down_sync(mask, value, delta, ...) \
  ::hetemu::shfl_down_sync((mask), (value), (delta), ::hetemu::width_or_warp(__VA_ARGS__), __FILE__, __LINE__)

namespace hetemu {
constexpr int width_or_warp() { return 32; }
constexpr int width_or_warp(int width) { return width; }
}  // namespace hetemu

// Device functions of the CUDA math and intrinsics headers that the kernels use.
inline int min(int a, int b) { return a < b ? a : b; }

// Round-to-nearest fp32 arithmetic, each operation rounded once: the emulator is built
// with -ffp-contract=off, so these plain operators are exactly what the intrinsics are.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }

inline unsigned int __float_as_uint(float v) {
  unsigned int u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

inline float __uint_as_float(unsigned int u) {
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// The 16-byte vector type. A copy through it is one ld/st.v4 on a GPU, which faults
// unless the address is a multiple of 16: every copy checks both addresses.
struct alignas(16) uint4 {
  unsigned int x, y, z, w;

  uint4() = default;
  uint4(const uint4& other) {
    ::hetemu::check_vector_access(&other, "load from");
    std::memcpy(this, &other, sizeof other);
  }
  uint4& operator=(const uint4& other) {
    ::hetemu::check_vector_access(&other, "load from");
    ::hetemu::check_vector_access(this, "store to");
    std::memcpy(this, &other, sizeof other);
    return *this;
  }
};
