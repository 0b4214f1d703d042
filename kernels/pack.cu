// Fused multi-tensor byte copies from a segment table that is built and uploaded once
// (pack_segments.cuh): the same-device copies of a plan as one launch
// (tidearray/backends/cuda/copies.py), and the benchmark baselines' copy-in and
// copy-out. FSDP2 does its layout conversion with one fused kernel per unit
// (all_gather_copy_in / _foreach_copy_, split_with_sizes_copy, _chunk_cat); a Python
// loop of per-parameter copies would be launch-bound. A unit is a byte; copies use
// 16-byte vectors when the segment is aligned.

#include "pack_segments.cuh"

#define BYTES_TILE 65536

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
