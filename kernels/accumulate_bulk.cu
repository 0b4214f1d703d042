// Opt-in accumulate (Config.accum_kernel = "bulk"): accumulate_bulk.cuh with 256
// threads and 6 stages of two 16 KB source slots (192 KB of shared memory per CTA),
// so that a small grid keeps pace with the copy engines.
// Entry points: tide_accumulate_bf16_bulk, tide_accumulate_fp16_bulk.

// Accumulator's BULK_BLOCK and BULK_SMEM (6 * 2 * 16384 + 6 * 8).
#define THREADS 256
// Six stages of 16 KB keep 5/6 of the ring in flight while one is read, where
// three of 32 KB would keep 2/3.
#define CHUNK 8192
#define STAGES 6
#define NAME bulk
#define BOUNDS __launch_bounds__(THREADS, 1)

#include "accumulate_bulk.cuh"
