// Runs y = cast(float(x) * scale) over a segment list on the CPU, in parallel over
// the whole workload rather than per tensor.
#pragma once

#include "cpu/span_kernels.h"
#include "ops/segment.h"

namespace hetcomm::cpu {

enum class Work {
  kScaleCast,              // pack, cast_
  kScaleCastCheckInput,    // unscale_: GradScaler checks the values before scaling
  kScaleCastCheckOutput,   // unpack_ without a norm
  kScaleCastCheckOutputSumSq,
};

// Returns whether any checked value was non-finite and the sum of squares of the
// written values (when asked). The sum is deterministic: partial sums belong to
// fixed-size chunks of the flat index space and are added in chunk order, whatever
// the number of threads.
SpanStats run_segments(const SegmentList& segments, float scale, Work work);

// Whether the element loops take their AVX2+FMA+F16C path in this process (the CPU
// has it and HETCOMM_CPU_ISA does not ask for the scalar loops).
bool use_avx2();

// The instruction set the element loops use in this process: "avx2+fma+f16c" or "scalar".
const char* vector_isa();

}  // namespace hetcomm::cpu
