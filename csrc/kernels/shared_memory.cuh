// HETCOMM_SHARED(type, name, dims) declares a __shared__ array: `__shared__ type name dims`
// under nvcc and NVRTC. A macro only so that the CPU emulator of the tests
// (tests/cuda_emulator) can fill shared memory with NaN at the start of every block,
// which makes a read before the write that a barrier should order show.
#pragma once

#ifndef HETCOMM_SHARED
#define HETCOMM_SHARED(type, name, dims) __shared__ type name dims
#endif
