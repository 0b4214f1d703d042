// Fused multi-tensor copies for the `stock`, `symm` and `nccl-bf16` baselines.
//
// FSDP2 does its layout conversion with one fused kernel per unit
// (all_gather_copy_in / _foreach_copy_, split_with_sizes_copy, _chunk_cat); a
// Python loop of per-parameter copies would be launch-bound and make the
// baselines look slower than they are. These kernels do the same work from a
// segment table that is built and uploaded once per unit:
//
//   copy-in   shard p                    -> flat[rank][off_p]
//   copy-out  flat[r][off_p] (valid rows) -> param p rows of rank r
//   chunk-cat grad p rows of rank r        -> flat32[r][off_p], padding rows zero
//
// A segment is (dst, src, valid, total, tile0): copy `valid` units from src,
// write zeros for units [valid, total), where a unit is a byte (pack_bytes) or
// a bf16 element (pack_bf16_f32). Segments are cut into fixed tiles; `tile0`
// is the segment's first tile in the table-wide tile index, increasing, so a
// CTA finds its segment by binary search. Segments with total == 0 are left
// out of the table. Copies use 16-byte vectors when the segment is aligned.

typedef unsigned long long u64;
typedef long long i64;

struct Seg {
    u64 dst;
    u64 src;
    i64 valid;
    i64 total;
    i64 tile0;
};

#define BYTES_TILE 65536
#define CVT_TILE 32768

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

extern "C" __global__ void pack_bytes(const Seg* __restrict__ segs, int nseg, i64 ntiles) {
    __shared__ int s_seg;
    for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        const Span sp = span_of(segs, nseg, tile, BYTES_TILE, &s_seg);
        const Seg& sg = sp.sg;
        const i64 begin = sp.begin, end = sp.end, vend = sp.vend;
        char* dst = (char*)sg.dst;
        const char* src = (const char*)sg.src;
        i64 scalar_from = begin;
        if (((sg.dst | sg.src) & 15) == 0 && vend > begin) {
            scalar_from = begin + ((vend - begin) & ~15LL);
            unrolled<16>(begin, scalar_from,
                         [&](i64 i) { return *(const uint4*)(src + i); },
                         [&](i64 i, uint4 v) { *(uint4*)(dst + i) = v; });
        }
        for (i64 i = scalar_from + threadIdx.x; i < vend; i += blockDim.x) dst[i] = src[i];
        for (i64 i = imax(begin, sg.valid) + threadIdx.x; i < end; i += blockDim.x) dst[i] = 0;
    }
}

__device__ __forceinline__ float bf16_to_f32(unsigned short x) {
    return __uint_as_float(((unsigned int)x) << 16);
}

// One 16-byte store. NVCC split plain float4/uint4 stores of the converted values below
// into four 4-byte stores (seen in the PTX), a quarter of the store width.
__device__ __forceinline__ void store16(void* p, uint4 v) {
    asm volatile("st.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// fp32 bit patterns of bf16 elements 0-3 (lo) and 4-7 (hi) of a 16-byte load.
__device__ __forceinline__ uint4 lo4(uint4 v) {
    return make_uint4(v.x << 16, v.x & 0xffff0000u, v.y << 16, v.y & 0xffff0000u);
}

__device__ __forceinline__ uint4 hi4(uint4 v) {
    return make_uint4(v.z << 16, v.z & 0xffff0000u, v.w << 16, v.w & 0xffff0000u);
}

// bf16 -> fp32 with zero padding (FSDP2's _chunk_cat into an fp32 reduce-scatter input).
extern "C" __global__ void pack_bf16_f32(const Seg* __restrict__ segs, int nseg, i64 ntiles) {
    __shared__ int s_seg;
    for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        const Span sp = span_of(segs, nseg, tile, CVT_TILE, &s_seg);
        const Seg& sg = sp.sg;
        const i64 begin = sp.begin, end = sp.end, vend = sp.vend;
        float* dst = (float*)sg.dst;
        const unsigned short* src = (const unsigned short*)sg.src;
        i64 scalar_from = begin;
        if ((sg.src & 15) == 0 && (sg.dst & 15) == 0 && vend > begin) {
            scalar_from = begin + ((vend - begin) & ~7LL);
            unrolled<8>(begin, scalar_from,
                        [&](i64 i) { return *(const uint4*)(src + i); },
                        [&](i64 i, uint4 v) {
                            store16(dst + i, lo4(v));
                            store16(dst + i + 4, hi4(v));
                        });
        }
        for (i64 i = scalar_from + threadIdx.x; i < vend; i += blockDim.x)
            dst[i] = bf16_to_f32(src[i]);
        for (i64 i = imax(begin, sg.valid) + threadIdx.x; i < end; i += blockDim.x) dst[i] = 0.f;
    }
}
