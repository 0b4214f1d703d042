"""Where the narrow accumulate's instructions go, per SASS instruction (diagnostic)

Under Nsight Compute, one launch each of the library's narrow kernel and the probe's
flat kernel (``narrow_probe.py``), two sources, each checked bitwise:

    ncu --section SourceCounters --section WarpStateStats --section InstructionStats \\
        -k regex:narrow -c 2 -o narrow python benchmarks/probes/narrow_sass.py
    ncu -i narrow.ncu-rep --page source --csv --print-source sass > sass.csv

then, on any machine, the source page as a record: per kernel, the instructions
executed and the warp-stall samples in all, and each SASS instruction executed at least
once per item (the hot path) with its counts:

    python benchmarks/probes/narrow_sass.py --record sass.csv RECORD.json [COMMIT]

With the narrow kernel's scale flag a run-time value, its source page showed the scale
loaded from the constant bank (``LDC``) before each multiply of a step
(benchmarks/results/run16-one-h200).
"""

from __future__ import annotations

import csv
import json
import os
import sys

sys.path.insert(0, os.getcwd())

#: Items of 2,048 elements per source in one launch (``narrow_probe.N``): an
#: instruction executed at least this often per launch runs once per item or more.
ITEMS = 109 * (1 << 20) // 2048


def launch() -> None:
    """One launch of each kernel, two sources, bitwise against CuPy's sum."""
    import cupy as cp
    import numpy as np

    from benchmarks.probes import narrow_probe as probe
    from benchmarks.variants.accumulate import StreamedAccumulator
    from tidearray._dtypes import bfloat16
    from tidearray.backends._base import AccumPiece

    dev, sms = probe.dev, probe.dev.num_sms
    scale = np.float32(0.5)
    srcs, want = probe.sources(2, scale)
    out = cp.full(probe.N, np.nan, cp.float32)
    acc = StreamedAccumulator(dev.dev.id, sms, kernel="narrow")
    acc.launch(dev.stream, (AccumPiece(out.data.ptr, tuple(s.data.ptr for s in srcs),
                                       probe.N),), bfloat16, float(scale))
    dev.sync()
    ok = {"library": bool(cp.array_equal(out, want))}
    fn, smem, _ = probe.narrow_kernel(2, 2048, 2, 2, "__maxnreg__(32)", 1, 0)
    out.fill(np.nan)
    with dev.stream:
        fn((sms,), (32,), (srcs[0], srcs[1], out, np.int64(probe.N // 2048), scale),
           shared_mem=smem)
    dev.sync()
    ok["flat"] = bool(cp.array_equal(out, want))
    print("bitwise:", ok, flush=True)
    sys.exit(0 if all(ok.values()) else 1)


def record(csv_path: str, commit: str) -> dict:
    """The source page's kernels: totals, and the instructions of the hot path."""
    kernels, name, head = {}, None, None
    with open(csv_path, newline="") as f:
        for row in csv.reader(f):
            if len(row) >= 2 and row[0] == "Kernel Name":
                name = row[1]
                kernels[name] = {"instructions_executed": 0, "stall_samples": 0, "hot": []}
            elif row and row[0] == "Address":
                head = {k: i for i, k in enumerate(row)}
            elif name and head and len(row) == len(head):
                k = kernels[name]
                executed = int(row[head["Instructions Executed"]])
                samples = int(row[head["Warp Stall Sampling (All Samples)"]])
                k["instructions_executed"] += executed
                k["stall_samples"] += samples
                if executed >= ITEMS:
                    k["hot"].append([row[head["Source"]].strip(), executed, samples])
    return {"commit": commit, "items": ITEMS, "kernels": kernels}


def main() -> None:
    if sys.argv[1:2] == ["--record"]:
        _, _, csv_path, path, *commit = sys.argv
        if not commit:
            from benchmarks.harness.records import git_commit
            commit = [git_commit()]
        with open(path, "w") as f:
            json.dump(record(csv_path, commit[0]), f, indent=1)
        return
    launch()


if __name__ == "__main__":
    main()
