// The segment tables of the fused multi-tensor copies (pack.cu's pack_bytes, and the
// benchmark baselines' bf16 -> fp32 chunk-cat in benchmarks/baselines/): a segment is
// (dst, src, valid, total, tile0): copy `valid` units from src, write zeros for units
// [valid, total). Segments are cut into fixed tiles; `tile0` is the segment's first tile
// in the table-wide tile index, increasing, so a CTA finds its segment by binary search.
// Segments with total == 0 are left out of the table (pack_table in
// tidearray/backends/cuda/kernels.py builds them). Inlined by the loader.

#pragma once

typedef unsigned long long u64;
typedef long long i64;

struct Seg {
    u64 dst;
    u64 src;
    i64 valid;
    i64 total;
    i64 tile0;
};

__device__ __forceinline__ i64 imin(i64 a, i64 b) { return a < b ? a : b; }
__device__ __forceinline__ i64 imax(i64 a, i64 b) { return a > b ? a : b; }

__device__ __forceinline__ int find_seg(const Seg* segs, int nseg, i64 tile) {
    int lo = 0, hi = nseg - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (segs[mid].tile0 <= tile) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// Runs st(i, ld(i)) for i = begin + threadIdx.x * UNITS, stepping by blockDim.x * UNITS,
// below vend; four loads are issued before their stores (memory-level parallelism).
template <int UNITS, typename Load, typename Store>
__device__ __forceinline__ void unrolled(i64 begin, i64 vend, Load ld, Store st) {
    const i64 step = (i64)blockDim.x * UNITS;
    i64 i = begin + (i64)threadIdx.x * UNITS;
    for (; i + 3 * step < vend; i += 4 * step) {
        const uint4 a = ld(i), b = ld(i + step), c = ld(i + 2 * step), d = ld(i + 3 * step);
        st(i, a);
        st(i + step, b);
        st(i + 2 * step, c);
        st(i + 3 * step, d);
    }
    for (; i < vend; i += step) st(i, ld(i));
}

// The segment that tile `tile` belongs to, and the tile's unit range in it: [begin, end)
// to write, [begin, vend) of it copied, the rest zero. Every thread of the CTA calls it.
struct Span {
    Seg sg;
    i64 begin, end, vend;
};

__device__ __forceinline__ Span span_of(const Seg* segs, int nseg, i64 tile, i64 units,
                                        int* s_seg) {
    if (threadIdx.x == 0) *s_seg = find_seg(segs, nseg, tile);
    __syncthreads();
    Span sp;
    sp.sg = segs[*s_seg];
    __syncthreads();  // s_seg is rewritten for the next tile
    sp.begin = (tile - sp.sg.tile0) * units;
    sp.end = imin(sp.begin + units, sp.sg.total);
    sp.vend = imin(sp.end, sp.sg.valid);
    return sp;
}
