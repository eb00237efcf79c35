"""The Triton kernels: one scale-and-cast pass over a table of rows, and the final
fixed-order sum of the per-row sums of squares.

A row is a bounded piece of one tensor (at most multi_tensor.CHUNK elements): its
source address, its destination address and its element count, as three int64 values
in a device table. One program handles one row, so one launch covers a whole tensor
list however many tensors it holds. The addresses are plain integers turned into
pointers inside the kernel. On a GPU they are device addresses; the interpreter
(TRITON_INTERPRET=1) runs kernels on CPU tensors in place and loads through host
addresses, so the same table and the same kernel work in both.

Math is the reference's: one fp32 multiply, one round-to-nearest-even cast.
"""

import triton
import triton.language as tl

_FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _row(table, row, SRC: tl.constexpr, DST: tl.constexpr, ALIGNED: tl.constexpr):
    src = tl.load(table + row * 3).to(tl.pointer_type(SRC))
    dst = tl.load(table + row * 3 + 1).to(tl.pointer_type(DST))
    n = tl.load(table + row * 3 + 2).to(tl.int32)  # at most CHUNK: 32-bit offsets are enough
    if ALIGNED:
        # The planner checked that every address of this launch is 16-byte aligned;
        # telling Triton lets it use 16-byte vector loads and stores. (The hint must be
        # on the pointers: it does not survive the integer-to-pointer cast.)
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
    return src, dst, n


@triton.jit
def _to_float32(x, DTYPE: tl.constexpr):
    """Exact widening. bf16 is widened by a shift, which is what the hardware does;
    the interpreter's own bf16 conversion is not bit-exact."""
    if DTYPE == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _from_float32(x, DTYPE: tl.constexpr):
    """Round to nearest even. bf16 is rounded with integer arithmetic, as torch does
    (NaN becomes 0x7FC0): the interpreter truncates instead, and GPUs before sm_80
    have no bf16 conversion instruction, so one formula serves every target."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _block(src, dst, offsets, n, scale, bad, SRC: tl.constexpr, DST: tl.constexpr, MASKED: tl.constexpr,
           CHECK_INPUT: tl.constexpr, CHECK_OUTPUT: tl.constexpr, SUM_SQ: tl.constexpr):
    """Scales and casts one block; returns the non-finite flags so far and the block's
    fp32 sum of squares of the written values (0 unless SUM_SQ)."""
    # Full blocks go unmasked: a mask that depends on n would stop vectorisation.
    if MASKED:
        mask = offsets < n
        x = _to_float32(tl.load(src + offsets, mask=mask, other=0.0), SRC)
    else:
        mask = None
        x = _to_float32(tl.load(src + offsets), SRC)
    y = _from_float32(x * scale, DST)
    tl.store(dst + offsets, y, mask=mask)
    if CHECK_INPUT:
        bad = bad | ~(tl.abs(x) <= _FLOAT32_MAX)
    # The written value, read back exactly in fp32; masked lanes count as 0 (with an
    # inf or NaN scale, 0 * scale would otherwise pollute the flag and the sum).
    written = _to_float32(y, DST)
    if MASKED:
        written = tl.where(mask, written, 0.0)
    if CHECK_OUTPUT:
        bad = bad | ~(tl.abs(written) <= _FLOAT32_MAX)
    sum_sq = 0.0
    if SUM_SQ:
        sum_sq = tl.sum(written * written, axis=0)
    return bad, sum_sq


@triton.jit(do_not_specialize=["size_class"])
def scale_cast_rows(table, first_row, scale_ptr, found_inf_ptr, partials_ptr, size_class,
                    SRC: tl.constexpr, DST: tl.constexpr, ALIGNED: tl.constexpr, CHECK_INPUT: tl.constexpr,
                    CHECK_OUTPUT: tl.constexpr, SUM_SQ: tl.constexpr, BLOCK: tl.constexpr):
    """dst = cast(src * scale) for row first_row + program_id(0) of the table.

    CHECK_INPUT / CHECK_OUTPUT: set *found_inf_ptr to 1 if a read / written value is
    ±inf or NaN (never cleared). SUM_SQ: write the row's sum of squares of the written
    values to partials_ptr[row] (fp32 per block, fp64 across the row's blocks).
    size_class only keys the autotuner (log2 of the launch's row count).
    """
    row = first_row + tl.program_id(0)
    src, dst, n = _row(table, row, SRC, DST, ALIGNED)
    scale = tl.load(scale_ptr)
    bad = tl.zeros((BLOCK,), dtype=tl.int1)
    row_sum = tl.zeros((), dtype=tl.float64)
    n_full = n // BLOCK * BLOCK
    for start in range(0, n_full, BLOCK):
        bad, block_sum = _block(src, dst, start + tl.arange(0, BLOCK), n, scale, bad, SRC, DST, False, CHECK_INPUT,
                                CHECK_OUTPUT, SUM_SQ)
        row_sum += block_sum
    if n_full < n:
        bad, block_sum = _block(src, dst, n_full + tl.arange(0, BLOCK), n, scale, bad, SRC, DST, True, CHECK_INPUT,
                                CHECK_OUTPUT, SUM_SQ)
        row_sum += block_sum
    if CHECK_INPUT or CHECK_OUTPUT:
        # Every program that saw a non-finite value stores the same 1.0: no race on
        # the result, and nothing to clear.
        if tl.max(bad.to(tl.int32), axis=0) != 0:
            tl.store(found_inf_ptr, 1.0)
    if SUM_SQ:
        tl.store(partials_ptr + row, row_sum)


@triton.jit
def add_sum(partials_ptr, count, sq_norm_ptr, BLOCK: tl.constexpr):
    """*sq_norm_ptr += float32(sum of partials[0:count]), summed in fp64 by one program
    in a fixed order, so the result is the same on every run."""
    total = tl.zeros((BLOCK,), dtype=tl.float64)
    for start in range(0, count, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        total += tl.load(partials_ptr + offsets, mask=offsets < count, other=0.0)
    sq_norm = tl.load(sq_norm_ptr)
    tl.store(sq_norm_ptr, sq_norm + tl.sum(total, axis=0).to(tl.float32))


# Whether these kernels were decorated under TRITON_INTERPRET=1 (Triton decides once,
# when a kernel is decorated, i.e. when this module is imported).
INTERPRETED = not isinstance(add_sum, triton.runtime.JITFunction)
