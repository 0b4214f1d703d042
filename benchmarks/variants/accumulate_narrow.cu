// A variant accumulate for bf16 / fp16 sources and fp32 out (StreamedAccumulator
// kernel="narrow", benchmarks/variants/accumulate.py): one warp per CTA at most 32 registers per thread, 16 KB of stages,
// one CTA per SM, one or two sources (the host sends more to accumulate.cu). It
// takes the arguments and the table of tide_accumulate_bf16 / fp16 in
// accumulate.cu and does the same arithmetic in the same order, so the results
// are bitwise the same.
//
// Why: a Hopper GEMM's CTA takes nearly a whole SM. The interference suite's
// cuBLAS kernels run 384 threads at 168 registers (64,512 of the SM's 65,536)
// with 184-208 KB of shared memory (benchmarks/probes/footprints.py), so no CTA of the
// vector or bulk kernel fits beside one: while those hold an SM, a GEMM's CTA
// waits for it. What a GEMM's CTA leaves is 1,024 registers and about 19 KB of
// shared memory: one warp at 32 registers, and this kernel's footprint. The
// bytes in flight are the bulk copies', which need no registers, and each
// stage's 8 KB is one bulk copy per source (benchmarks/probes/narrow_probe.py: stages
// of 2 KB took 1.55 times as long as stages of 8 KB).
//
// Work: CTA b takes the contiguous tiles [b * T / G, (b + 1) * T / G) and walks
// them as one run of elements, piece by piece, so the table is searched once per
// CTA and read once per piece, not once per tile: one warp waits out each of
// those reads alone.
//
// Pipeline: lane 0 produces, every lane consumes, two stages. An item is a chunk
// of up to chunk_of(n_src) elements of one piece (every source in one stage,
// summed in order as accumulate.cu does), the scalar part of a piece
// (unaligned pieces and ragged tails, read from global memory), or the end.
// Lane 0 writes the item's descriptor into its stage, issues the bulk copies,
// and arrives on the stage's mbarrier, expecting their bytes (none for the
// other kinds); the lanes wait on it, read the descriptor and the stage, and,
// once all have (__syncwarp), lane 0 produces the next item into that stage.
// The walk's cursor lives in shared memory, to keep the registers for the sums.
// The source count and whether to scale are constants: the entry picks the
// kernel's instance once, and a chunk's sums compile with no run-time branch.
//
// Output: 16-byte streaming stores straight from registers.
// Entry points: tide_accumulate_bf16_narrow, tide_accumulate_fp16_narrow.

#include "accumulate_common.cuh"
#include "bulk_copy.cuh"

// NARROW_BLOCK, NARROW_SMEM and NARROW_MAX_SOURCES in accumulate.py (checked at entry).
#define THREADS 32
#define STAGES 2
#define STAGE_BYTES 8192
#define MAX_SOURCES 2

enum Kind { END = 0, BULK = 1, SCALAR = 2 };

// One stage's item: elements [lo, hi) of the piece whose output is `out` and
// whose sources are `srcs` (a row of the table).
struct Item {
    float* out;
    const i64* srcs;
    i64 lo, hi;
    int kind;
};

// Lane 0's walk: piece p, the next element e, and where its part of the CTA's
// run ends (limit) and where the bulk part ends (bulk_end); the piece's source
// pointers copied out of the table (src), so that issuing a chunk's copies waits
// on no global load.
struct Cursor {
    const i64* srcs;
    float* out;
    i64 e, limit, bulk_end, numel, p;
    const u16* src[MAX_SOURCES];
};

// Dynamic shared memory: the stages, then an 8-byte mbarrier per stage, the
// stages' items and the cursor, in 512 bytes.
#define DATA_BYTES (STAGES * STAGE_BYTES)
#define SMEM_BYTES (DATA_BYTES + 512)
static_assert(8 * STAGES + STAGES * sizeof(Item) + sizeof(Cursor) <= 512, "SMEM_BYTES");

struct Launch {
    const i64* table;
    int n_pieces, n_src;
    i64 t1, tile;  // the CTA's run ends at tile t1
    int chunk;     // elements per source per stage
};

// Piece p, from element e: its output, sources and ends within the CTA's run.
__device__ void enter(Cursor& k, const Launch& l, i64 p, i64 e) {
    const i64* entry = l.table + 4 * p;
    const i64 numel = entry[1], first = entry[3];
    const i64 run_end = (l.t1 - first) * l.tile;  // the run ends inside this piece, or after
    k.p = p;
    k.e = e;
    k.numel = numel;
    k.out = reinterpret_cast<float*>(entry[0]);
    k.srcs = l.table + 4 * (i64)l.n_pieces + p * l.n_src;
    for (int j = 0; j < l.n_src; ++j) k.src[j] = reinterpret_cast<const u16*>(k.srcs[j]);
    k.limit = run_end < numel ? run_end : numel;
    k.bulk_end = entry[2] ? (k.limit < numel ? k.limit : numel / 8 * 8) : e;
}

// Lane 0: the next item into stage s (its descriptor, its copies, its arrival), with
// NSrc sources.
template <int NSrc>
__device__ void produce(Cursor& k, const Launch& l, Item* items, unsigned data, unsigned bars,
                        int s) {
    bool end = false;
    while (k.e >= k.limit) {  // this piece's part is done: the next piece, or the end
        end = k.limit < k.numel || k.p + 1 >= l.n_pieces || l.table[4 * (k.p + 1) + 3] >= l.t1;
        if (end) break;
        enter(k, l, k.p + 1, 0);
    }
    Item it{k.out, k.srcs, k.e, end ? k.e : k.limit, end ? END : SCALAR};
    unsigned bytes = 0;
    if (!end && k.e < k.bulk_end) {
        it.hi = k.bulk_end - k.e < l.chunk ? k.bulk_end : k.e + l.chunk;
        it.kind = BULK;
        bytes = 2 * (unsigned)(it.hi - it.lo);
    }
    k.e = it.hi;
    items[s] = it;
    const unsigned bar = bars + 8 * s;
    // The lanes' generic-proxy reads of the stage come before the async-proxy writes.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    barrier_expect(bar, bytes * NSrc);  // release: the descriptor is visible to waiters
    if (bytes) {
#pragma unroll
        for (int j = 0; j < NSrc; ++j) {
            bulk_load(data + s * STAGE_BYTES + j * 2 * l.chunk, k.src[j] + it.lo, bytes, bar);
        }
    }
}

// Every lane: out = scale * (s0 + s1 + ...) over `steps` 8-element steps of a
// stage, source j at slot + j * stride. NSrc and Steps are the source count and
// the steps where the caller knows them, else 0: with both known the loops unroll
// and each step's loads go out together (one warp hides no latency behind another).
// DoScale is a constant too: with a run-time flag the compiler reloaded the scale
// from the constant bank before every multiply (ncu's source page, 2 sources).
template <int IsBf16, int NSrc, int Steps, int DoScale>
__device__ __forceinline__ void consume(float* out, const uint4* slot, int steps, int n_src,
                                        int stride, float scale) {
    const int count = NSrc ? NSrc : n_src;
#pragma unroll 2
    for (int u = threadIdx.x; u < (Steps ? Steps : steps); u += THREADS) {
        float v[8];
        const uint4 x = slot[u];
        widen4(make_uint2(x.x, x.y), IsBf16, v);
        widen4(make_uint2(x.z, x.w), IsBf16, v + 4);
#pragma unroll
        for (int j = 1; j < count; ++j) {
            const uint4 y = slot[j * (Steps ? Steps : stride) + u];
            float w[8];
            widen4(make_uint2(y.x, y.y), IsBf16, w);
            widen4(make_uint2(y.z, y.w), IsBf16, w + 4);
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = __fadd_rn(v[e], w[e]);
        }
        store4(out + 8 * (i64)u, make_float4(finish(v[0], scale, DoScale),
                                             finish(v[1], scale, DoScale),
                                             finish(v[2], scale, DoScale),
                                             finish(v[3], scale, DoScale)));
        store4(out + 8 * (i64)u + 4, make_float4(finish(v[4], scale, DoScale),
                                                 finish(v[5], scale, DoScale),
                                                 finish(v[6], scale, DoScale),
                                                 finish(v[7], scale, DoScale)));
    }
}

// Elements per source per stage for n_src sources: a multiple of 256 (every
// lane's 8-element steps).
__host__ __device__ constexpr int chunk_of(int n_src) {
    return STAGE_BYTES / 2 / n_src / 256 * 256;
}

// With NSrc sources: a whole chunk with the counts as constants, else the steps
// counted at run time (a piece's last chunk).
template <int IsBf16, int NSrc, int DoScale>
__device__ __forceinline__ void consume_known(float* out, const uint4* slot, int steps,
                                              float scale) {
    constexpr int kSteps = chunk_of(NSrc) / 8;
    if (steps == kSteps) {
        consume<IsBf16, NSrc, kSteps, DoScale>(out, slot, steps, NSrc, kSteps, scale);
    } else {
        consume<IsBf16, 0, 0, DoScale>(out, slot, steps, NSrc, kSteps, scale);
    }
}

// A bulk item of NSrc sources.
template <int IsBf16, int NSrc>
__device__ __forceinline__ void consume_item(const Item& it, const uint4* slot, float scale,
                                             int do_scale) {
    float* out = it.out + it.lo;
    const int steps = (int)(it.hi - it.lo) / 8;
    if (do_scale) {
        consume_known<IsBf16, NSrc, 1>(out, slot, steps, scale);
    } else {
        consume_known<IsBf16, NSrc, 0>(out, slot, steps, scale);
    }
}

// The kernel, with the source count (1 or 2) as a constant throughout.
template <int IsBf16, int NSrc>
__device__ __forceinline__ void accumulate_narrow(const i64* table, int n_pieces, i64 n_tiles, i64 tile,
                                  float scale, int do_scale) {
    extern __shared__ __align__(128) unsigned char smem[];
    Item* items = reinterpret_cast<Item*>(smem + DATA_BYTES + 8 * STAGES);
    Cursor* cursor = reinterpret_cast<Cursor*>(items + STAGES);
    const unsigned data = smem_addr(smem), bars = data + DATA_BYTES;
    const i64 t0 = (i64)blockIdx.x * n_tiles / gridDim.x;
    const Launch l{table, n_pieces, NSrc, ((i64)blockIdx.x + 1) * n_tiles / gridDim.x, tile,
                   chunk_of(NSrc)};
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) barrier_init(bars + 8 * s);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        const TileAt at = locate(table, n_pieces, t0, tile);
        enter(*cursor, l, at.p, at.a);
        for (int s = 0; s < STAGES; ++s) produce<NSrc>(*cursor, l, items, data, bars, s);
    }
    __syncwarp();
    int stage = 0;
    unsigned parity = 0;
    for (;;) {
        barrier_wait(bars + 8 * stage, parity);
        const Item it = items[stage];
        if (it.kind == END) break;
        if (it.kind == BULK) {
            consume_item<IsBf16, NSrc>(
                it, reinterpret_cast<const uint4*>(smem + stage * STAGE_BYTES), scale, do_scale);
        } else {
            scalar_range(it.srcs, NSrc, it.out, it.lo, it.hi, IsBf16, scale, do_scale);
        }
        __syncwarp();  // every lane has read the stage: refill it
        if (threadIdx.x == 0) produce<NSrc>(*cursor, l, items, data, bars, stage);
        __syncwarp();
        if (++stage == STAGES) {
            stage = 0;
            parity ^= 1;
        }
    }
}

template <int IsBf16>
__device__ __forceinline__ void accumulate_narrow_entry(const i64* table, int n_pieces, int n_src,
                                                        i64 n_tiles, i64 tile, float scale,
                                                        int do_scale) {
    unsigned dynamic_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_smem));
    if (blockDim.x != THREADS || dynamic_smem < SMEM_BYTES || n_src < 1 || n_src > MAX_SOURCES) {
        __trap();  // host and kernel disagree
    }
    if (n_src == 1) {
        accumulate_narrow<IsBf16, 1>(table, n_pieces, n_tiles, tile, scale, do_scale);
    } else {
        accumulate_narrow<IsBf16, 2>(table, n_pieces, n_tiles, tile, scale, do_scale);
    }
}

extern "C" __global__ void __maxnreg__(32)
tide_accumulate_bf16_narrow(const i64* table, int n_pieces, int n_src, i64 n_tiles, i64 tile,
                            float scale, int do_scale) {
    accumulate_narrow_entry<1>(table, n_pieces, n_src, n_tiles, tile, scale, do_scale);
}

extern "C" __global__ void __maxnreg__(32)
tide_accumulate_fp16_narrow(const i64* table, int n_pieces, int n_src, i64 n_tiles, i64 tile,
                            float scale, int do_scale) {
    accumulate_narrow_entry<0>(table, n_pieces, n_src, n_tiles, tile, scale, do_scale);
}
