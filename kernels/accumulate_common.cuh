// Helpers shared by the accumulate kernels (accumulate.cu, accumulate_bulk.cu):
// 16-bit -> fp32 widening, the fused scale, the streaming fp32 store, and the
// walk from a tile to its piece in the host's table (the layout is described
// at the top of accumulate.cu). Inlined textually by the loader
// (tidearray/backends/cuda/kernels.py), so NVRTC needs no include path.

#pragma once

#include "round.cuh"

typedef long long i64;

__device__ __forceinline__ float load_one(const u16* p, int is_bf16) {
    u16 h = *p;
    if (is_bf16) {
        return __uint_as_float(((unsigned int)h) << 16);
    }
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float half_bits_to_float(unsigned int h16, int is_bf16) {
    if (is_bf16) {
        return __uint_as_float(h16 << 16);
    }
    float f;
    unsigned short h = (unsigned short)h16;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Four 16-bit values (an 8-byte word) as fp32.
__device__ __forceinline__ void widen4(uint2 w, int is_bf16, float v[4]) {
    v[0] = half_bits_to_float(w.x & 0xffffu, is_bf16);
    v[1] = half_bits_to_float(w.x >> 16, is_bf16);
    v[2] = half_bits_to_float(w.y & 0xffffu, is_bf16);
    v[3] = half_bits_to_float(w.y >> 16, is_bf16);
}

__device__ __forceinline__ float finish(float acc, float scale, int do_scale) {
    return do_scale ? __fmul_rn(acc, scale) : acc;
}

__device__ __forceinline__ void store4(float* p, float4 v) {
    asm volatile("st.global.cs.v4.f32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}

// Tile t of a launch: its piece's entry, and its element range [a, b) in that piece.
struct TileAt {
    i64 p, a, b;
};

__device__ __forceinline__ TileAt locate(const i64* pieces, int n_pieces, i64 t, i64 tile) {
    int lo = 0, hi = n_pieces - 1;  // the last piece whose first tile is <= t
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (pieces[4 * mid + 3] <= t) lo = mid; else hi = mid - 1;
    }
    i64 a = (t - pieces[4 * lo + 3]) * tile;
    i64 numel = pieces[4 * lo + 1];
    return {lo, a, a + tile < numel ? a + tile : numel};
}

// Elements [lo, hi) of a piece, one at a time (unaligned pieces, ragged tails).
__device__ void scalar_range(const i64* srcs, int n_src, float* out, i64 lo, i64 hi,
                             int is_bf16, float scale, int do_scale) {
    for (i64 j = lo + threadIdx.x; j < hi; j += blockDim.x) {
        float acc = load_one(reinterpret_cast<const u16*>(srcs[0]) + j, is_bf16);
        for (int s = 1; s < n_src; ++s) {
            acc = __fadd_rn(acc, load_one(reinterpret_cast<const u16*>(srcs[s]) + j, is_bf16));
        }
        out[j] = finish(acc, scale, do_scale);
    }
}
