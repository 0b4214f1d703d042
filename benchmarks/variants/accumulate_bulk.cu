// A variant accumulate for bf16 / fp16 sources and fp32 out (StreamedAccumulator
// kernel="bulk", benchmarks/variants/accumulate.py). It takes the arguments and the table of tide_accumulate_bf16 /
// fp16 in accumulate.cu and does the same arithmetic in the same order, so the
// results are bitwise the same; only the way the sources reach the SM differs.
//
// Why: a CTA's bandwidth is its bytes in flight over the memory latency. The
// vector kernel keeps 2 * UNROLL 16-byte loads per thread in flight and ran at
// about 50 GB/s per SM on H200. Here one thread streams the sources into shared
// memory with Hopper bulk async copies (1-D cp.async.bulk, no tensor map),
// completed on an mbarrier per stage, and keeps up to STAGES stages of two
// sources in flight: 192 KB per CTA, so a small grid can keep pace.
//
// Pipeline. A CTA's loads form one sequence: for each of its tiles
// (grid-stride), for each sub-chunk of CHUNK elements of the tile's bulk part,
// for each group of up to two sources. Load k goes to stage k % STAGES, and
// every thread waits for that stage's mbarrier phase before reading it (the
// parity flips at each reuse). Thread 0 issues the first STAGES loads; after
// all threads have read load k out of its stage (__syncthreads), it issues
// load k + STAGES into that stage. Thread 0's Feed and the consumers' loops walk
// the same sequence, so they share no other state. The sequence runs on across
// tiles, so the ring does not drain at a tile's end (a tile can be a single
// sub-chunk).
//
// Bulk part: bulk copies need 16-byte aligned addresses and sizes. A tile
// starts a multiple of 8192 elements into its piece, so where the piece is
// aligned (vec flag) the tile's first (b - a) / 8 * 8 elements go in bulk. The
// ragged tail (fewer than 8 elements), and all of a tile whose piece is not
// aligned, go through a scalar loop, as in accumulate.cu.
//
// Output: 16-byte streaming stores straight from registers; each store of a
// warp covers 512 contiguous bytes. Not bulk stores from shared memory:
// stores retire without waiting, so they need no bytes in flight to reach
// bandwidth, and an fp32 staging area (twice the bytes of a 16-bit source)
// would take the shared memory that keeps the loads in flight.

#include "accumulate_common.cuh"
#include "bulk_copy.cuh"

// Threads per block: BULK_BLOCK in accumulate.py (checked at entry).
#define THREADS 256
// Elements per source per stage (16 KB). Tiles are multiples of 8192
// elements, so only a piece's last sub-chunk is ever short; six stages of
// 16 KB keep 5/6 of the ring in flight while one is read, where three of
// 32 KB would keep 2/3.
#define CHUNK 8192
#define STAGES 6
// Sources per stage: the hot case (two ranks' gradients) is one group; one
// source fills half of each stage, more take several stages per sub-chunk.
#define GROUP 2
#define SRC_BYTES (2 * CHUNK)  // one source's slot in a stage
#define DATA_BYTES (STAGES * GROUP * SRC_BYTES)
// Dynamic shared memory: the stages, then one 8-byte mbarrier per stage.
// BULK_SMEM in accumulate.py (checked at entry).
#define SMEM_BYTES (DATA_BYTES + 8 * STAGES)
// 4-element units of a sub-chunk per thread: unit u is elements [4u, 4u + 4).
#define UNITS (CHUNK / 4 / THREADS)

__device__ __forceinline__ int groups_of(int n_src) { return (n_src + GROUP - 1) / GROUP; }

// Tile t: its piece's sources and output, and its range [a, b), of which [a, vend)
// goes in bulk.
struct Span {
    const i64* srcs;
    float* out;
    i64 a, vend, b;
};

__device__ __forceinline__ Span span_of(const i64* table, int n_pieces, int n_src, i64 t,
                                        i64 tile) {
    TileAt at = locate(table, n_pieces, t, tile);
    const i64* entry = table + 4 * at.p;
    i64 vend = entry[2] ? at.a + (at.b - at.a) / 8 * 8 : at.a;
    return {table + 4 * (i64)n_pieces + at.p * n_src, reinterpret_cast<float*>(entry[0]),
            at.a, vend, at.b};
}

// The launch's fixed arguments, as the loads and the walk need them.
struct Launch {
    const i64* table;
    int n_pieces, n_src;
    i64 n_tiles, tile;
};

// The next load thread 0 issues: source group g of the sub-chunk at c of tile t;
// t >= n_tiles once every load is issued.
struct Feed {
    Span span;
    i64 t, c;
    int g;
};

// Step to the next load: the next group, else the next sub-chunk, else the first
// sub-chunk of the next tile that has a bulk part.
__device__ void feed_next(Feed& f, const Launch& l) {
    if (++f.g < groups_of(l.n_src)) return;
    f.g = 0;
    f.c += CHUNK;
    while (f.c >= f.span.vend) {
        f.t += gridDim.x;
        if (f.t >= l.n_tiles) return;
        f.span = span_of(l.table, l.n_pieces, l.n_src, f.t, l.tile);
        f.c = f.span.a;
    }
}

// The CTA's first load (positioned just before it, then stepped onto it).
__device__ Feed feed_start(const Launch& l) {
    Feed f{};
    f.t = (i64)blockIdx.x - (i64)gridDim.x;
    f.g = groups_of(l.n_src) - 1;
    feed_next(f, l);
    return f;
}

// Thread 0: start the feed's load into stage s, which every thread has finished reading.
__device__ void feed_issue(const Feed& f, const Launch& l, unsigned data, unsigned bars,
                           int s) {
    const int first = GROUP * f.g;
    const int count = l.n_src - first < GROUP ? l.n_src - first : GROUP;
    const unsigned bytes = 2 * (unsigned)(f.span.vend - f.c < CHUNK ? f.span.vend - f.c : CHUNK);
    const unsigned bar = bars + 8 * s;
    // The threads' generic-proxy reads of the stage come before the async-proxy writes.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    barrier_expect(bar, bytes * count);
    for (int k = 0; k < count; ++k) {
        const u16* src = reinterpret_cast<const u16*>(f.span.srcs[first + k]) + f.c;
        bulk_load(data + (s * GROUP + k) * SRC_BYTES, src, bytes, bar);
    }
}

// acc = the slot's source (first), or acc += it: this thread's units of the sub-chunk.
__device__ __forceinline__ void add_slot(float acc[UNITS][4], const uint2* slot, int first,
                                         int units, int is_bf16) {
#pragma unroll
    for (int k = 0; k < UNITS; ++k) {
        const int u = k * THREADS + threadIdx.x;  // a warp reads 256 contiguous bytes
        if (u < units) {
            float v[4];
            widen4(slot[u], is_bf16, v);
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[k][e] = first ? v[e] : __fadd_rn(acc[k][e], v[e]);
        }
    }
}

__device__ __forceinline__ void store_units(float* out, const float acc[UNITS][4], int units,
                                            float scale, int do_scale) {
#pragma unroll
    for (int k = 0; k < UNITS; ++k) {
        const int u = k * THREADS + threadIdx.x;
        if (u < units) {
            store4(out + 4 * (i64)u,
                   make_float4(finish(acc[k][0], scale, do_scale),
                               finish(acc[k][1], scale, do_scale),
                               finish(acc[k][2], scale, do_scale),
                               finish(acc[k][3], scale, do_scale)));
        }
    }
}

template <int IsBf16>
__device__ void accumulate_bulk(const Launch& l, float scale, int do_scale) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned dynamic_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_smem));
    if (blockDim.x != THREADS || dynamic_smem < SMEM_BYTES) __trap();  // host and kernel disagree
    const unsigned data = smem_addr(smem), bars = data + DATA_BYTES;
    const int groups = groups_of(l.n_src);
    Feed feed{};
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) barrier_init(bars + 8 * s);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();  // the barriers are initialised before anyone waits on them
    if (threadIdx.x == 0) {
        feed = feed_start(l);
        for (int s = 0; s < STAGES && feed.t < l.n_tiles; ++s) {
            feed_issue(feed, l, data, bars, s);
            feed_next(feed, l);
        }
    }
    int stage = 0;
    unsigned parity = 0;
    for (i64 t = blockIdx.x; t < l.n_tiles; t += gridDim.x) {
        const Span sp = span_of(l.table, l.n_pieces, l.n_src, t, l.tile);
        for (i64 c = sp.a; c < sp.vend; c += CHUNK) {
            const int units = (int)((sp.vend - c < CHUNK ? sp.vend - c : CHUNK) / 4);
            float acc[UNITS][4];
            for (int g = 0; g < groups; ++g) {  // sources in order: s0 + s1, + s2, + s3 ...
                barrier_wait(bars + 8 * stage, parity);
                const uint2* slot =
                    reinterpret_cast<const uint2*>(smem + stage * GROUP * SRC_BYTES);
                add_slot(acc, slot, g == 0, units, IsBf16);
                if (GROUP * g + 1 < l.n_src) add_slot(acc, slot + CHUNK / 4, 0, units, IsBf16);
                __syncthreads();  // every thread has read the stage: refill it
                if (threadIdx.x == 0 && feed.t < l.n_tiles) {
                    feed_issue(feed, l, data, bars, stage);
                    feed_next(feed, l);
                }
                if (++stage == STAGES) {
                    stage = 0;
                    parity ^= 1;
                }
            }
            store_units(sp.out + c, acc, units, scale, do_scale);
        }
        scalar_range(sp.srcs, l.n_src, sp.out, sp.vend, sp.b, IsBf16, scale, do_scale);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
tide_accumulate_bf16_bulk(const i64* table, int n_pieces, int n_src, i64 n_tiles, i64 tile,
                          float scale, int do_scale) {
    accumulate_bulk<1>(Launch{table, n_pieces, n_src, n_tiles, tile}, scale, do_scale);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
tide_accumulate_fp16_bulk(const i64* table, int n_pieces, int n_src, i64 n_tiles, i64 tile,
                          float scale, int do_scale) {
    accumulate_bulk<0>(Launch{table, n_pieces, n_src, n_tiles, tile}, scale, do_scale);
}
