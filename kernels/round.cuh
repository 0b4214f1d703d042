// fp32 -> 16-bit rounding shared by the kernels that write param-dtype values
// (adamw.cu, accumulate.cu). Included textually by the loader
// (tidearray/backends/cuda/kernels.py), so NVRTC needs no include path.

#pragma once

typedef unsigned short u16;

// fp32 -> bf16, round to nearest even (what ml_dtypes' astype does). Adding
// 0x7fff plus the lowest kept bit carries into the kept half exactly when the
// dropped half is above one half, or equal to it with an odd kept half;
// overflow carries into the exponent and gives inf, as it should. NaN would
// carry into the sign or become inf, so it becomes the signed quiet NaN that
// ml_dtypes gives (0x7fc0 or 0xffc0): bitwise equal to astype there too.
__device__ __forceinline__ u16 to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (u16)(((u >> 16) & 0x8000u) | 0x7fc0u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// fp32 -> fp16, round to nearest even (cvt.rn; NumPy's astype rounds the same).
// Only NaN differs from NumPy: cvt gives the canonical 0x7fff, NumPy keeps the
// sign and the payload's top bits. Both are NaN.
__device__ __forceinline__ u16 to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
