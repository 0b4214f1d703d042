"""Which CTAs can share an SM (diagnostic).

    python benchmarks/probes/footprints.py [RECORD.json]

A CTA stays on its SM until it ends, and a second kernel's CTA starts on that SM only
if the registers, shared memory and threads left there hold it. This reads the
footprint per CTA of the interference suite's GEMMs (their cuBLAS kernels, from CUPTI)
and of tidearray's kernels (from the compiled functions), and says for each pair
whether one CTA of each fits on one SM of this device, and what room a GEMM's CTA
leaves. One process, no timing: the figures are the kernels' and the device's own.

Registers go to a CTA per warp, in units of 256; shared memory per CTA is its static
plus dynamic bytes plus the driver's reserve per CTA.
"""

from __future__ import annotations

import json
import os
import sys

import cupy

sys.path.insert(0, os.getcwd())
from benchmarks.harness import cupti  # noqa: E402
from benchmarks.harness.device import CudaDevice  # noqa: E402
from benchmarks.harness.interference import GEMMS  # noqa: E402
from benchmarks.harness.records import git_commit  # noqa: E402
from benchmarks.variants import accumulate as variants  # noqa: E402
from tidearray.backends.cuda import accumulate, copies, kernels  # noqa: E402

#: tidearray's kernels that may run beside a GEMM, and the accumulate variants of
#: benchmarks/variants: (file of kernels/ or variant name, kernel, threads, dynamic smem).
OURS = (("accumulate.cu", "tide_accumulate_bf16", accumulate.BLOCK, 0),
        ("bulk", "tide_accumulate_bf16_bulk", variants.BULK_BLOCK, variants.BULK_SMEM),
        ("narrow", "tide_accumulate_bf16_narrow", variants.NARROW_BLOCK, variants.NARROW_SMEM),
        ("pack.cu", "pack_bytes", copies.KERNEL_THREADS, 0))


def regs_per_cta(registers: int, threads: int) -> int:
    warps = -(-threads // 32)
    return warps * -(-registers * 32 // 256) * 256


def main() -> None:
    dev = cupy.cuda.Device()
    attrs = dev.attributes
    sm = {"registers": attrs["MaxRegistersPerMultiprocessor"],
          "shared_bytes": attrs["MaxSharedMemoryPerMultiprocessor"],
          "threads": attrs["MaxThreadsPerMultiProcessor"],
          "reserved_shared_per_cta": attrs.get("ReservedSharedMemoryPerBlock", 1024),
          "sms": attrs["MultiProcessorCount"]}
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    record = {"commit": git_commit(), "device": props["name"].decode(), "sm": sm,
              "gemms": {}, "ours": {}, "fits": []}
    print(f"{record['device']}: {sm['sms']} SMs; per SM {sm['registers']:,} registers, "
          f"{sm['shared_bytes'] // 1024} KiB shared, {sm['threads']} threads; "
          f"{sm['reserved_shared_per_cta']} bytes of shared reserved per CTA")

    bench = CudaDevice()
    for name, (m, n, k) in GEMMS.items():
        fn = bench.gemm(m, n, k)
        fn()

        def once(fn=fn) -> None:
            fn()
            cupy.cuda.Device().synchronize()

        events = cupti.trace(once)
        if events is None:
            sys.exit("CUPTI is not reachable (torch.profiler): no GEMM footprints")
        main_kernel = max((e for e in events if e["cat"] == "kernel"), key=lambda e: e["dur_us"])
        record["gemms"][name] = {key: main_kernel[key] for key in
                                 ("name", "blocks", "threads", "registers", "shared_bytes")}

    for file, kernel, threads, dynamic in OURS:
        fn = (variants.module(file, dev.id).get_function(kernel) if file in variants.STREAMED
              else kernels.function(file, kernel, dev.id))
        record["ours"][kernel] = {"threads": threads, "registers": fn.num_regs,
                                  "shared_bytes": fn.shared_size_bytes + dynamic,
                                  "local_bytes": fn.local_size_bytes}  # spills

    def need(k: dict) -> dict:
        return {"registers": regs_per_cta(k["registers"], k["threads"]),
                "shared_bytes": k["shared_bytes"] + sm["reserved_shared_per_cta"],
                "threads": k["threads"]}

    for gname, g in record["gemms"].items():
        left = {key: sm[key] - v for key, v in need(g).items()}
        print(f"\n{gname}: {g['name']}\n  {g['blocks']} CTAs x {g['threads']} threads, "
              f"{g['registers']} registers, {g['shared_bytes'] / 1024:.0f} KiB shared; "
              f"left on its SM: {left['registers']:,} registers, "
              f"{left['shared_bytes'] / 1024:.1f} KiB shared, {left['threads']} threads")
        for kname, o in record["ours"].items():
            want = need(o)
            short = [key for key in want if want[key] > left[key]]
            record["fits"].append({"gemm": gname, "kernel": kname, "fits": not short,
                                   "short_of": short, "needs": want, "left": left})
            print(f"  {kname} ({o['threads']} threads, {o['registers']} registers, "
                  f"{o['shared_bytes'] / 1024:.0f} KiB shared, {o['local_bytes']} B local): "
                  + ("fits beside it" if not short else
                     "does not fit beside it (" + ", ".join(
                         f"{key}: needs {want[key]:,}, {left[key]:,} left" for key in short)
                     + ")"))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(record, f, indent=1)
        print(f"\nrecord: {sys.argv[1]}")


if __name__ == "__main__":
    main()
