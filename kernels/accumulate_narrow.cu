// Opt-in accumulate (Config.accum_kernel = "narrow"): accumulate_bulk.cuh with one
// warp per CTA, at most 32 registers per thread and 8 stages of two 1 KB source
// slots (16 KB of shared memory).
//
// Why: a GEMM's CTA on Hopper takes nearly a whole SM. The interference suite's
// cuBLAS kernels run 384 threads at 168 registers (64,512 of the SM's 65,536) with
// 184-208 KB of shared memory (tests/gpu/footprints.py), so no CTA of the vector or
// bulk kernel fits beside one: while those hold an SM, a GEMM CTA waits for it. What
// a GEMM CTA leaves is 1,024 registers and about 19 KB of shared memory, one warp's
// worth at 32 registers. A CTA of this shape fits there, so a GEMM and the
// accumulate can share every SM; the bytes in flight are the bulk copies', which
// need no registers.
// Entry points: tide_accumulate_bf16_narrow, tide_accumulate_fp16_narrow.

// Accumulator's NARROW_BLOCK and NARROW_SMEM (8 * 2 * 1024 + 8 * 8).
#define THREADS 32
#define CHUNK 512
#define STAGES 8
#define NAME narrow
#define BOUNDS __maxnreg__(32)

#include "accumulate_bulk.cuh"
