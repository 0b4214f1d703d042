// Fused AdamW over the FSDP shard arena: fp32 master, moments and gradient in,
// master and moments updated in place, and the param-dtype send copy written
// in the same pass (no separate cast kernel).
//
// Launched by tidearray/fsdp/_optim.py (FusedAdamW._step_cupy), one kernel per
// send dtype: adamw_bf16, adamw_f16, adamw_f32, or adamw_none when there is no
// send copy (the gathers cast the masters). Where elements differ in their
// coefficients (parameter groups, or parameters at different step counts) the
// adamw_grouped_* variants run instead: each element's coefficient row comes
// from a uint8 row index, and the rows from a table passed by value (rows 0 to
// ADAMW_MAX_GROUPS - 1); with more rows in use, the adamw_table_* variants read
// them from device memory (up to ADAMW_MAX_ROWS). An element whose row is
// ADAMW_SKIP (a parameter with no gradient this step) is neither read nor
// written. The host folds the hyper-parameters and each row's step count into
// float32 coefficients (_adamw.coefficients), so the kernel and the NumPy path
// read the very same float32 values ([Note: AdamW math] in _adamw.py; the rows:
// [Note: absent gradients] in _rows.py).
//
// Per element, in float32, each operation rounded to nearest even:
//
//   g     = grad * grad_scale
//   p     = master * decay                     decay     = 1 - lr * weight_decay
//   m     = beta1 * m + omb1 * g               omb1      = 1 - beta1
//   v     = beta2 * v + omb2 * (g * g)         omb2      = 1 - beta2
//   denom = sqrt(v) / bc2_sqrt + eps           bc2_sqrt  = sqrt(1 - beta2^step)
//   p     = p - step_size * (m / denom)        step_size = lr / (1 - beta1^step)
//   master = p; exp_avg = m; exp_avg_sq = v; send = round_to_nearest_even(p)
//
// This is torch.optim.AdamW's formulation (decoupled decay first; denom as
// sqrt(v) / sqrt(bc2) + eps; addcdiv by -step_size). Every operation is an
// explicit _rn intrinsic: they are never contracted into FMAs (NVRTC fuses
// a * b + c by default), and division and sqrt are IEEE-exact whatever the
// compile flags, so the result is bitwise what NumPy's float32 ufuncs give.
//
// No system headers: the rounding (round.cuh, inlined by the loader) is integer
// arithmetic on the float's bits or one cvt instruction.

#include "round.cuh"

typedef long long i64;

struct Coeffs {
    float decay, beta1, omb1, beta2, omb2, eps, step_size, bc2_sqrt, grad_scale;
};

// Rows of the by-value table (the most parameter groups, the default one (0)
// included): MAX_GROUPS in _adamw.py.
#define ADAMW_MAX_GROUPS 16
// Most rows of a device table (MAX_ROWS in _rows.py), and the row index of an
// element that is skipped (SKIP): together every value of a uint8.
#define ADAMW_MAX_ROWS 254
#define ADAMW_SKIP 255

// Rows 0 to ADAMW_MAX_GROUPS - 1 of coefficients, one kernel argument: 16 * 9
// floats (576 bytes, well inside the 4 KiB of kernel parameters), laid out as
// the host's float32 array of shape (MAX_GROUPS, 9) (_optim._coeff_table).
// Passed by value, so a step copies nothing to the device; unused rows are zero
// and never read.
struct CoeffTable {
    Coeffs c[ADAMW_MAX_GROUPS];
};

// Where the send copy goes, one type per send dtype (so the loop is one template).
struct SendBf16 {
    u16* p;
    __device__ __forceinline__ void store(i64 i, float v) const { p[i] = to_bf16(v); }
};

struct SendF16 {
    u16* p;
    __device__ __forceinline__ void store(i64 i, float v) const { p[i] = to_f16(v); }
};

struct SendF32 {
    float* p;
    __device__ __forceinline__ void store(i64 i, float v) const { p[i] = v; }
};

// No send copy: the gathers cast the masters themselves (GatherPlan's cast).
struct SendNone {
    float* p;  // unused (null)
    __device__ __forceinline__ void store(i64, float) const {}
};

// One element's update; returns the new master value. Order as in the header.
__device__ __forceinline__ float update(float* master, float* exp_avg, float* exp_avg_sq,
                                        const float* grad, i64 i, const Coeffs& c) {
    float g = __fmul_rn(grad[i], c.grad_scale);
    float p = __fmul_rn(master[i], c.decay);
    float m = __fadd_rn(__fmul_rn(c.beta1, exp_avg[i]), __fmul_rn(c.omb1, g));
    float v = __fadd_rn(__fmul_rn(c.beta2, exp_avg_sq[i]), __fmul_rn(c.omb2, __fmul_rn(g, g)));
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), c.bc2_sqrt), c.eps);
    // p - x as p + (-x): negation is exact, and __fadd_rn is never contracted.
    p = __fadd_rn(p, -__fmul_rn(c.step_size, __fdiv_rn(m, denom)));
    master[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    return p;
}

// Where element i's coefficients come from, one type per kind of launch (so the
// loop is one template): row(i) is its row index (ADAMW_SKIP: leave it alone),
// get(r) that row's coefficients. One set for every element...
struct OneGroup {
    Coeffs c;
    __device__ __forceinline__ int row(i64) const { return 0; }
    __device__ __forceinline__ const Coeffs& get(int) const { return c; }
};

// ...or the row of element i, from a table passed by value. The table stays the
// kernel argument, in the parameter (constant) bank; rows are contiguous runs
// of the arena, so a warp's lanes mostly read one row, which the constant cache
// broadcasts. The host writes no index >= ADAMW_MAX_GROUPS but ADAMW_SKIP.
struct Grouped {
    const unsigned char* index;
    const CoeffTable& table;
    __device__ __forceinline__ int row(i64 i) const { return index[i]; }
    __device__ __forceinline__ const Coeffs& get(int r) const { return table.c[r]; }
};

// ...or the row of element i, from a table in device memory (ADAMW_MAX_ROWS rows,
// float32 (rows, 9), the same layout): more rows than the by-value table holds,
// and a captured step's coefficients, which the host rewrites between replays.
struct Rows {
    const unsigned char* index;
    const Coeffs* rows;
    __device__ __forceinline__ int row(i64 i) const { return index[i]; }
    __device__ __forceinline__ const Coeffs& get(int r) const { return rows[r]; }
};

// Grid-stride loop, scalar and coalesced: the kernel is bound by memory
// (16 bytes read, 1 more with a row index, and 12 + sizeof(send element)
// written per element), and scalar accesses keep it correct for shards at any
// alignment in the arena. A skipped element costs its index byte only: its
// master, moments and send element keep their bits (OneGroup's row is the
// constant 0, so its launches compile without the test).
template <typename Send, typename Coef>
__device__ __forceinline__ void adamw_loop(float* master, float* exp_avg, float* exp_avg_sq,
                                           const float* grad, Send send, i64 n,
                                           const Coef& coef) {
    i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        int r = coef.row(i);
        if (r == ADAMW_SKIP) {
            continue;
        }
        send.store(i, update(master, exp_avg, exp_avg_sq, grad, i, coef.get(r)));
    }
}

// The entry points differ only in the send pointer's type (adamw_none: no send
// copy, the pointer is ignored). Arguments,
// in order: master, exp_avg, exp_avg_sq, grad, send, n, then the float32
// coefficients decay, beta1, omb1, beta2, omb2, eps, step_size, bc2_sqrt,
// grad_scale (their meaning is in the header).
#define ADAMW_KERNEL(NAME, SEND, SEND_ELEM)                                              \
    extern "C" __global__ void NAME(float* master, float* exp_avg, float* exp_avg_sq,    \
                                    const float* grad, SEND_ELEM* send, i64 n,           \
                                    float decay, float beta1, float omb1, float beta2,   \
                                    float omb2, float eps, float step_size,              \
                                    float bc2_sqrt, float grad_scale) {                  \
        const Coeffs c = {decay, beta1, omb1, beta2, omb2, eps, step_size, bc2_sqrt,     \
                          grad_scale};                                                   \
        adamw_loop(master, exp_avg, exp_avg_sq, grad, SEND{send}, n, OneGroup{c});       \
    }

ADAMW_KERNEL(adamw_bf16, SendBf16, u16)
ADAMW_KERNEL(adamw_f16, SendF16, u16)
ADAMW_KERNEL(adamw_f32, SendF32, float)
ADAMW_KERNEL(adamw_none, SendNone, float)

// Grouped entry points. Arguments, in order: master, exp_avg, exp_avg_sq, grad,
// send, n, index (one uint8 row per element: < ADAMW_MAX_GROUPS, or ADAMW_SKIP),
// table (CoeffTable).
#define ADAMW_GROUPED_KERNEL(NAME, SEND, SEND_ELEM)                                          \
    extern "C" __global__ void NAME(float* master, float* exp_avg, float* exp_avg_sq,        \
                                    const float* grad, SEND_ELEM* send, i64 n,               \
                                    const unsigned char* index, const CoeffTable table) {    \
        adamw_loop(master, exp_avg, exp_avg_sq, grad, SEND{send}, n, Grouped{index, table}); \
    }

ADAMW_GROUPED_KERNEL(adamw_grouped_bf16, SendBf16, u16)
ADAMW_GROUPED_KERNEL(adamw_grouped_f16, SendF16, u16)
ADAMW_GROUPED_KERNEL(adamw_grouped_f32, SendF32, float)
ADAMW_GROUPED_KERNEL(adamw_grouped_none, SendNone, float)

// Entry points that read the coefficients from device memory: what a captured
// step launches (tidearray/fsdp/_graph.py), since a CUDA graph replays its kernel
// arguments as captured, while the step number and the learning rate change on
// every replay; and an eager step whose rows outgrow the by-value table. The
// host writes the same float32 rows as a by-value table would hold
// (_optim._coeff_rows), so the bits are those of the by-value kernels. index is
// null where every element reads row 0. Arguments, in order: master, exp_avg,
// exp_avg_sq, grad, send, n, index (uint8: < ADAMW_MAX_ROWS, or ADAMW_SKIP), rows
// (float32, ADAMW_MAX_ROWS rows of 9).
#define ADAMW_TABLE_KERNEL(NAME, SEND, SEND_ELEM)                                            \
    extern "C" __global__ void NAME(float* master, float* exp_avg, float* exp_avg_sq,        \
                                    const float* grad, SEND_ELEM* send, i64 n,               \
                                    const unsigned char* index, const Coeffs* rows) {        \
        if (index) {                                                                         \
            adamw_loop(master, exp_avg, exp_avg_sq, grad, SEND{send}, n,                     \
                       Rows{index, rows});                                                   \
        } else {                                                                             \
            adamw_loop(master, exp_avg, exp_avg_sq, grad, SEND{send}, n, OneGroup{rows[0]}); \
        }                                                                                    \
    }

ADAMW_TABLE_KERNEL(adamw_table_bf16, SendBf16, u16)
ADAMW_TABLE_KERNEL(adamw_table_f16, SendF16, u16)
ADAMW_TABLE_KERNEL(adamw_table_f32, SendF32, float)
ADAMW_TABLE_KERNEL(adamw_table_none, SendNone, float)
