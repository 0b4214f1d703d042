// Multi-source accumulate for TIDE-RS: bf16 / fp16 / fp32 in, fp32 out; and,
// for fp32 sources, bf16 / fp16 out (a gather's cast of fp32 masters into its
// slot is an accumulate of one source: tide_cast_bf16, tide_cast_fp16).
//
// One launch covers a whole chunk of a reduce-scatter: many pieces (one per
// parameter slice), each with the same number of sources. The host builds a
// table of int64 words (tidearray/backends/cuda/accumulate.py, build_table):
//
//   pieces[4 * n_pieces] : out pointer, numel, vector flag (1 = every pointer
//                          of the piece is 16-byte aligned), first tile
//   srcs[n_src * n_pieces]: source pointers, piece-major, in summation order
//
// Piece p covers tiles [first_p, first_{p+1}) of `tile` elements each. Blocks
// walk the tiles grid-stride (so the grid stays small: half the SMs by
// default, Config.accum_ctas) and find a tile's piece by binary search over
// the first tiles. For each element: acc = s0; acc += s1; ...;
// out = acc * scale, in fp32 with round-to-nearest and no contraction, which
// is bitwise what the host backend computes; a 16-bit out is then rounded to
// nearest even (round.cuh), as ml_dtypes' and NumPy's astype do. The multiply
// is skipped when do_scale is 0 (scale == 1).
//
// No system headers: bf16 -> fp32 is a shift, fp16 -> fp32 is one cvt
// instruction, and round.cuh and accumulate_common.cuh are inlined by the
// loader.

#include "round.cuh"
#include "accumulate_common.cuh"

// Streaming 8-byte load: every byte is read once, so do not keep it in L1.
__device__ __forceinline__ uint2 load8(const u16* p) {
    return __ldcs(reinterpret_cast<const uint2*>(p));
}

// Streaming store, ordered by the compiler like any store (no asm barrier), so the
// loads of the next steps may be issued before it.
__device__ __forceinline__ void store4f(float* out, const float acc[4], float scale,
                                        int do_scale) {
    __stcs(reinterpret_cast<float4*>(out),
           make_float4(finish(acc[0], scale, do_scale), finish(acc[1], scale, do_scale),
                       finish(acc[2], scale, do_scale), finish(acc[3], scale, do_scale)));
}

__device__ __forceinline__ void add4h(float acc[4], uint2 q, int is_bf16) {
    float v[4];
    widen4(q, is_bf16, v);
#pragma unroll
    for (int k = 0; k < 4; ++k) acc[k] = __fadd_rn(acc[k], v[k]);
}

// Vector steps per thread per iteration, for each 16-bit source: 2 * UNROLL_16
// independent 8-byte loads are in flight before the first add. A CTA's bandwidth
// is its bytes in flight over the memory latency, and a small grid (few SMs) still
// has to keep pace with the copy engines.
#define UNROLL_16 8

// Two sources, U vector steps per thread per iteration from i while they fit before
// vend: each step summed and stored as soon as its loads land (no accumulators held
// across steps). Returns where it stopped.
template <int U>
__device__ __forceinline__ i64 pair_steps(const u16* s0, const u16* s1, float* out, i64 i,
                                          i64 step, i64 vend, int is_bf16, float scale,
                                          int do_scale) {
    for (; i + (U - 1) * step < vend; i += U * step) {
        uint2 q[U], r[U];
#pragma unroll
        for (int u = 0; u < U; ++u) q[u] = load8(s0 + i + u * step);
#pragma unroll
        for (int u = 0; u < U; ++u) r[u] = load8(s1 + i + u * step);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float acc[4];
            widen4(q[u], is_bf16, acc);
            add4h(acc, r[u], is_bf16);
            store4f(out + i + u * step, acc, scale, do_scale);
        }
    }
    return i;
}

// Any number of sources, U vector steps per thread per iteration (as pair_steps):
// acc = s0 + s1, then += s2, += s3 ..., in that order. Returns where it stopped.
template <int U>
__device__ __forceinline__ i64 many_steps(const i64* srcs, int n_src, float* out, i64 i,
                                          i64 step, i64 vend, int is_bf16, float scale,
                                          int do_scale) {
    for (; i + (U - 1) * step < vend; i += U * step) {
        float acc[U][4];
        uint2 q[U], r[U];
        const u16* s0 = reinterpret_cast<const u16*>(srcs[0]);
        const u16* s1 = reinterpret_cast<const u16*>(srcs[n_src > 1 ? 1 : 0]);
#pragma unroll
        for (int u = 0; u < U; ++u) q[u] = load8(s0 + i + u * step);
        if (n_src > 1) {
#pragma unroll
            for (int u = 0; u < U; ++u) r[u] = load8(s1 + i + u * step);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            widen4(q[u], is_bf16, acc[u]);
            if (n_src > 1) add4h(acc[u], r[u], is_bf16);
        }
        for (int s = 2; s < n_src; s += 2) {  // the same order: acc += s, then s + 1
            const int pair = s + 1 < n_src;
            const u16* sp = reinterpret_cast<const u16*>(srcs[s]);
            const u16* sq = reinterpret_cast<const u16*>(srcs[pair ? s + 1 : s]);
#pragma unroll
            for (int u = 0; u < U; ++u) q[u] = load8(sp + i + u * step);
            if (pair) {
#pragma unroll
                for (int u = 0; u < U; ++u) r[u] = load8(sq + i + u * step);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                add4h(acc[u], q[u], is_bf16);
                if (pair) add4h(acc[u], r[u], is_bf16);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) store4f(out + i + u * step, acc[u], scale, do_scale);
    }
    return i;
}

// 16-bit sources: 4 elements (8 bytes of each source, 16 of fp32 out) per vector
// step, so that a warp's stores cover whole 32-byte sectors: with 8 elements per
// step each store instruction wrote half of every sector it touched, and a CTA
// streamed at about half the rate. With two sources (two ranks) each step is summed
// and stored as soon as its loads land: half the registers, and a CTA streams about
// as fast as a plain copy (tests/gpu/hw_bounds.py). What is left of a tile after the
// full unroll goes 4 and then 2 steps at a time, not one: a short tile (a grid of one
// CTA per tile, 8,192 elements: 4 steps per thread) still keeps several loads in flight.
__device__ void tile_16(const i64* srcs, int n_src, float* out, i64 a, i64 b, int vec,
                        int is_bf16, float scale, int do_scale) {
    i64 vend = vec ? a + ((b - a) / 4) * 4 : a;
    const i64 step = 4 * (i64)blockDim.x;
    i64 i = a + 4 * (i64)threadIdx.x;
    if (n_src == 2) {  // two ranks
        const u16* s0 = reinterpret_cast<const u16*>(srcs[0]);
        const u16* s1 = reinterpret_cast<const u16*>(srcs[1]);
        i = pair_steps<UNROLL_16>(s0, s1, out, i, step, vend, is_bf16, scale, do_scale);
        i = pair_steps<4>(s0, s1, out, i, step, vend, is_bf16, scale, do_scale);
        i = pair_steps<2>(s0, s1, out, i, step, vend, is_bf16, scale, do_scale);
    }  // what is left: three sources or more, or fewer than 2 steps
    i = many_steps<UNROLL_16>(srcs, n_src, out, i, step, vend, is_bf16, scale, do_scale);
    i = many_steps<4>(srcs, n_src, out, i, step, vend, is_bf16, scale, do_scale);
    i = many_steps<2>(srcs, n_src, out, i, step, vend, is_bf16, scale, do_scale);
    for (; i < vend; i += step) {
        float acc[4];
        widen4(load8(reinterpret_cast<const u16*>(srcs[0]) + i), is_bf16, acc);
        for (int s = 1; s < n_src; ++s) {
            add4h(acc, load8(reinterpret_cast<const u16*>(srcs[s]) + i), is_bf16);
        }
        store4f(out + i, acc, scale, do_scale);
    }
    scalar_range(srcs, n_src, out, vend, b, is_bf16, scale, do_scale);
}

// Where an fp32 result goes: one type per output dtype (so the loop is one template).
struct OutF32 {
    float* p;
    __device__ __forceinline__ void store4(i64 i, float4 v) const {
        *reinterpret_cast<float4*>(p + i) = v;
    }
    __device__ __forceinline__ void store1(i64 i, float v) const { p[i] = v; }
};

template <u16 (*Round)(float)>
struct Out16 {
    u16* p;
    __device__ __forceinline__ void store4(i64 i, float4 v) const {  // 8 bytes, aligned
        uint2 w;
        w.x = (unsigned int)Round(v.x) | ((unsigned int)Round(v.y) << 16);
        w.y = (unsigned int)Round(v.z) | ((unsigned int)Round(v.w) << 16);
        *reinterpret_cast<uint2*>(p + i) = w;
    }
    __device__ __forceinline__ void store1(i64 i, float v) const { p[i] = Round(v); }
};

__device__ __forceinline__ float4 load16f(const float* p) {  // streaming, as load16
    float4 r;
    asm("ld.global.cs.v4.f32 {%0, %1, %2, %3}, [%4];"
        : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ void add4(float4& acc, float4 v) {
    acc.x = __fadd_rn(acc.x, v.x);
    acc.y = __fadd_rn(acc.y, v.y);
    acc.z = __fadd_rn(acc.z, v.z);
    acc.w = __fadd_rn(acc.w, v.w);
}

__device__ __forceinline__ float4 finish4(float4 acc, float scale, int do_scale) {
    return make_float4(finish(acc.x, scale, do_scale), finish(acc.y, scale, do_scale),
                       finish(acc.z, scale, do_scale), finish(acc.w, scale, do_scale));
}

// Vector steps per thread per iteration for fp32 sources (16-byte loads and stores).
#define UNROLL 4

// fp32 sources: 4 elements per vector step, UNROLL steps per thread in flight
// (a cast of masters into a slot reads one source and must keep pace with HBM).
template <typename Out>
__device__ void tile_32(const i64* srcs, int n_src, Out out, i64 a, i64 b, int vec,
                        float scale, int do_scale) {
    i64 vend = vec ? a + ((b - a) / 4) * 4 : a;
    const i64 step = 4 * (i64)blockDim.x;
    const float* s0 = reinterpret_cast<const float*>(srcs[0]);
    i64 i = a + 4 * (i64)threadIdx.x;
    for (; i + (UNROLL - 1) * step < vend; i += UNROLL * step) {
        float4 acc[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc[u] = load16f(s0 + i + u * step);
        for (int s = 1; s < n_src; ++s) {
            const float* sp = reinterpret_cast<const float*>(srcs[s]);
            float4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) v[u] = load16f(sp + i + u * step);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) add4(acc[u], v[u]);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) out.store4(i + u * step, finish4(acc[u], scale, do_scale));
    }
    for (; i < vend; i += step) {
        float4 acc = load16f(s0 + i);
        for (int s = 1; s < n_src; ++s) add4(acc, load16f(reinterpret_cast<const float*>(srcs[s]) + i));
        out.store4(i, finish4(acc, scale, do_scale));
    }
    for (i64 j = vend + threadIdx.x; j < b; j += blockDim.x) {
        float acc = s0[j];
        for (int s = 1; s < n_src; ++s) {
            acc = __fadd_rn(acc, reinterpret_cast<const float*>(srcs[s])[j]);
        }
        out.store1(j, finish(acc, scale, do_scale));
    }
}

// kind: 0 = bf16, 1 = fp16, 2 = fp32 sources; fp32 out.
__device__ void accumulate(const i64* table, int n_pieces, int n_src, i64 n_tiles, i64 tile,
                           float scale, int do_scale, int kind) {
    const i64* pieces = table;
    const i64* srcs = table + 4 * (i64)n_pieces;
    for (i64 t = blockIdx.x; t < n_tiles; t += gridDim.x) {
        TileAt at = locate(pieces, n_pieces, t, tile);
        float* out = reinterpret_cast<float*>(pieces[4 * at.p]);
        int vec = (int)pieces[4 * at.p + 2];
        const i64* ps = srcs + at.p * n_src;
        if (kind == 2) {
            tile_32(ps, n_src, OutF32{out}, at.a, at.b, vec, scale, do_scale);
        } else {
            tile_16(ps, n_src, out, at.a, at.b, vec, kind == 0, scale, do_scale);
        }
    }
}

// fp32 sources, 16-bit out.
template <typename Out>
__device__ void accumulate_to_16(const i64* table, int n_pieces, int n_src, i64 n_tiles,
                                 i64 tile, float scale, int do_scale) {
    const i64* pieces = table;
    const i64* srcs = table + 4 * (i64)n_pieces;
    for (i64 t = blockIdx.x; t < n_tiles; t += gridDim.x) {
        TileAt at = locate(pieces, n_pieces, t, tile);
        Out out{reinterpret_cast<u16*>(pieces[4 * at.p])};
        tile_32(srcs + at.p * n_src, n_src, out, at.a, at.b, (int)pieces[4 * at.p + 2],
                scale, do_scale);
    }
}

extern "C" __global__ void tide_accumulate_bf16(const i64* table, int n_pieces, int n_src,
                                                i64 n_tiles, i64 tile, float scale,
                                                int do_scale) {
    accumulate(table, n_pieces, n_src, n_tiles, tile, scale, do_scale, 0);
}

extern "C" __global__ void tide_accumulate_fp16(const i64* table, int n_pieces, int n_src,
                                                i64 n_tiles, i64 tile, float scale,
                                                int do_scale) {
    accumulate(table, n_pieces, n_src, n_tiles, tile, scale, do_scale, 1);
}

extern "C" __global__ void tide_accumulate_fp32(const i64* table, int n_pieces, int n_src,
                                                i64 n_tiles, i64 tile, float scale,
                                                int do_scale) {
    accumulate(table, n_pieces, n_src, n_tiles, tile, scale, do_scale, 2);
}

extern "C" __global__ void tide_cast_bf16(const i64* table, int n_pieces, int n_src,
                                          i64 n_tiles, i64 tile, float scale, int do_scale) {
    accumulate_to_16<Out16<to_bf16>>(table, n_pieces, n_src, n_tiles, tile, scale, do_scale);
}

extern "C" __global__ void tide_cast_fp16(const i64* table, int n_pieces, int n_src,
                                          i64 n_tiles, i64 tile, float scale, int do_scale) {
    accumulate_to_16<Out16<to_f16>>(table, n_pieces, n_src, n_tiles, tile, scale, do_scale);
}
