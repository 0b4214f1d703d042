// The benchmark baselines' chunk-cat: bf16 gradient rows into an fp32 flat buffer, padding
// zeroed (FSDP2's _chunk_cat into an fp32 reduce-scatter input), from a segment table
// of the library's form (kernels/pack_segments.cuh, inlined by
// benchmarks/baselines/pack.py). A unit is a bf16 element.

#include "pack_segments.cuh"

#define CVT_TILE 32768

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
