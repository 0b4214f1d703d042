// The global gradient norm for clipping, on the device, in a fixed order, so that an
// eager step and a captured (CUDA graph) step compute the same bits.
//
// Launched by tidearray/fsdp/_norm.py (GlobalNorm):
//
//   sum_squares_blocks  NORM_BLOCKS blocks of NORM_THREADS threads: block b's sum of
//                       squares of the float32 gradient shard, in float64, into
//                       partial[b];
//   sum_squares_total   one block: the sum of those partials, into total[0] (this
//                       rank's sum of squares, which the ranks then all-gather);
//   clip_finish         one thread: the ranks' sums added in rank order, the norm
//                       sqrt(total) * scale, and, where a coefficient table is given
//                       (a captured step), the clip factor written into every row's
//                       grad_scale (the AdamW table kernels read it; see adamw.cu).
//
// Every sum runs in the same order on every call: a thread's elements in index order,
// then a fixed tree over the block's threads, then the blocks in a fixed tree. The
// operations are _rn intrinsics, never contracted into FMAs, and float64 sqrt and
// division are correctly rounded, so clip_finish's arithmetic is bitwise what the
// host's Python floats give for the same inputs (_norm.clip_scale).

typedef long long i64;

// NORM_BLOCKS and NORM_THREADS in _norm.py: a fixed grid, so that the order of the sums
// (and so their bits) depends on the shard's length only.
#define NORM_BLOCKS 1024
#define NORM_THREADS 256

// s[0] = the sum of s[0..NORM_THREADS), in a fixed tree; every thread must call it.
__device__ __forceinline__ void block_sum(double* s) {
    for (int w = NORM_THREADS / 2; w > 0; w >>= 1) {
        __syncthreads();
        if (threadIdx.x < w) {
            s[threadIdx.x] = __dadd_rn(s[threadIdx.x], s[threadIdx.x + w]);
        }
    }
}

extern "C" __global__ void sum_squares_blocks(const float* grad, i64 n, double* partial) {
    __shared__ double s[NORM_THREADS];
    double acc = 0.0;
    i64 stride = (i64)NORM_BLOCKS * NORM_THREADS;
    for (i64 i = (i64)blockIdx.x * NORM_THREADS + threadIdx.x; i < n; i += stride) {
        double x = (double)grad[i];
        acc = __dadd_rn(acc, __dmul_rn(x, x));
    }
    s[threadIdx.x] = acc;
    block_sum(s);
    if (threadIdx.x == 0) {
        partial[blockIdx.x] = s[0];
    }
}

extern "C" __global__ void sum_squares_total(const double* partial, double* total) {
    __shared__ double s[NORM_THREADS];
    double acc = 0.0;
    for (int b = threadIdx.x; b < NORM_BLOCKS; b += NORM_THREADS) {
        acc = __dadd_rn(acc, partial[b]);
    }
    s[threadIdx.x] = acc;
    block_sum(s);
    if (threadIdx.x == 0) {
        total[0] = s[0];
    }
}

// per_rank: each rank's sum of squares, rank 0 first. scale: the factor from the summed
// to the averaged gradient (the norm is the averaged gradient's). With table not null,
// grad_scale = round_to_float(scale * clip_scale(norm, max_norm)) goes into field
// `field` of each of `rows` rows of `width` floats: _norm.clip_scale's arithmetic,
//     coef = max_norm / (norm + 1e-6), kept where below 1 or NaN, else 1.
extern "C" __global__ void clip_finish(const double* per_rank, int world, double scale,
                                       double max_norm, double* norm, float* table, int rows,
                                       int width, int field) {
    if (blockIdx.x != 0 || threadIdx.x != 0) {
        return;
    }
    double total = per_rank[0];
    for (int r = 1; r < world; ++r) {
        total = __dadd_rn(total, per_rank[r]);
    }
    double nrm = __dmul_rn(__dsqrt_rn(total), scale);
    norm[0] = nrm;
    if (table == nullptr) {
        return;
    }
    double coef = __ddiv_rn(max_norm, __dadd_rn(nrm, 1e-6));
    if (!(coef < 1.0) && coef == coef) {  // 1 or more (NaN stays NaN, as in torch)
        coef = 1.0;
    }
    float grad_scale = __double2float_rn(__dmul_rn(scale, coef));
    for (int r = 0; r < rows; ++r) {
        table[r * width + field] = grad_scale;
    }
}
