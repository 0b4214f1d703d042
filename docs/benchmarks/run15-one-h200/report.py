"""This page, from the records here (run from the repo root):

    python docs/benchmarks/run15-one-h200/report.py > docs/benchmarks/run15-one-h200/README.md

Every record comes from one H200 (nvidia-h200): footprints from ``tests/gpu/footprints.py``,
the rest from ``python -m tidearray.bench interference`` at one rank (its ``run`` record
gives the commit, argv and ``TIDE_*`` settings).
"""
import json
import os

HERE = "docs/benchmarks/run15-one-h200"
GEMM = "gemm-1024x2048x16384"


def load(name):
    """(settings, {metric: record}) of a bench.jsonl's interference records of tide."""
    settings, recs = {}, {}
    for line in open(os.path.join(HERE, name)):
        r = json.loads(line)
        if r["suite"] == "run":
            settings = r["extra"]
        elif r["suite"] == "interference" and r["impl"] == "tide" and r["status"] == "ok":
            recs[r["metric"]] = r
    return settings, recs


def us(v):
    return "-" if v is None else f"{v * 1e6:,.0f}"


def group(t, name):
    d = t[name]
    return "-" if d["median_us"] is None else f"{d['median_us']:.1f} ({d['n']})"


def footprint(k):
    return (f"{k.get('blocks', '')} CTAs x " if k.get("blocks") else "") + (
        f"{k['threads']} threads, {k['registers']} registers, "
        f"{k['shared_bytes'] / 1024:.0f} KiB shared")


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def footprints():
    fp = json.load(open(os.path.join(HERE, "footprints-a3d4b71.json")))
    sm = fp["sm"]
    out = ["## Which CTAs can share an SM with a GEMM's\n",
           f"`python tests/gpu/footprints.py`, {fp['device']} at `{fp['commit']}` "
           f"([footprints-a3d4b71.json](footprints-a3d4b71.json); "
           f"[footprints-c8405f1.json](footprints-c8405f1.json), before the narrow kernel, "
           f"is the same for the others). Per SM: {sm['registers']:,} registers, "
           f"{sm['shared_bytes'] // 1024} KiB of shared memory, {sm['threads']:,} threads; "
           f"the driver keeps {sm['reserved_shared_per_cta']:,} bytes of shared memory per "
           "CTA. Registers go to a CTA per warp, in units of 256.\n"]
    out.append(table(["GEMM (M x N x K)", "cuBLAS kernel", "footprint", "left on its SM"],
                     [[g, f"`{k['name']}`", footprint(k),
                       f"{sm['registers'] - 384 * k['registers']:,} registers, "
                       f"{(sm['shared_bytes'] - k['shared_bytes'] - 1024) / 1024:.1f} KiB"]
                      for g, k in fp["gemms"].items()]))
    fits = {f["kernel"]: f for f in fp["fits"] if f["gemm"] == GEMM}
    out.append("\n" + table(["tidearray's kernel", "footprint per CTA", f"one CTA beside {GEMM}'s"],
                            [[f"`{n}`", footprint(k),
                              "fits" if fits[n]["fits"] else "does not fit (" + ", ".join(
                                  fits[n]["short_of"]) + ")"]
                             for n, k in fp["ours"].items()]))
    return "\n".join(out)


def grouped(rows, label):
    head = [label, "GEMM alone (us)", "beside (us)", "slowdown", "CUPTI: alone", "clear",
            "some", "held", "the collective's kernel", "TIDE-RS alone (us)"]
    body = []
    for name, what in rows:
        settings, recs = load(name)
        r = recs[f"rs:{GEMM}"]
        ex = r["extra"]
        t = ex["cupti"]
        kern = "; ".join(f"`{n}` {footprint(k)}" for n, k in t["kernels"].items())
        body.append([what, us(ex["alone_s"]), us(ex["under_s"]), f"{r['value'] * 100:+.1f}%",
                     group(t, "alone"), group(t, "clear"), group(t, "partial"),
                     group(t, "held"), kern, us(ex["collective_alone_s"])])
    return table(head, body)


def main():
    print("# One H200: which CTAs share an SM with a GEMM, and two levers\n\n"
          "Generated from the records here by [report.py](report.py): `python "
          f"{HERE}/report.py > {HERE}/README.md`.\n")
    print("Development screens on one GPU, not benchmark figures: one rank, so TIDE-RS is "
          "its accumulate alone (no peer, no copy-engine traffic), and its time is not "
          "TIDE-RS's between two GPUs. They say which way a lever moves the GEMM beside the "
          "accumulate; the figures for the goals are the 2xH200 runs'. CUPTI columns: the "
          "GEMM kernel's median time in us (count) alone and beside the collective, by how "
          "much of it the collective's kernels covered: none (clear), some, or half or more "
          "(held). A kernel's CUPTI time starts with its first CTA: a GEMM that waited "
          "before any of its CTAs could start shows that wait in the timed slowdown only.\n")
    print(footprints(), end="\n\n")
    print("## The narrow accumulate: one warp per SM (code at `a3d4b71`, dropped)\n")
    print("The bulk-copy accumulate as one warp per CTA at 32 registers with 16 KiB of "
          "shared memory, one CTA per SM: it fits where a GEMM's CTA leaves room (above). "
          "Launched in turn with the default kernel, `TIDE_ACCUM_KERNEL` as named, "
          "`mpirun -n 1 python -m tidearray.bench interference --impls tide`:\n")
    print(grouped([("narrow/vector.jsonl", "vector (default), 66 CTAs"),
                   ("narrow/narrow.jsonl", "narrow, 132 CTAs")], "accumulate"), end="\n\n")
    print("The GEMMs it held ran about as fast as alone, but TIDE-RS took about nine times "
          "as long. Between two GPUs it would have to keep pace with the copy engines, so it "
          "was dropped. The reason this page first gave, one warp's instruction issue, was "
          "wrong: one warp issues far more than this kernel used, and a one-warp kernel that "
          "needs no piece table streamed two sources at 2.6 elements per ns per SM on the same "
          "GPU. The cost was in the kernel (its walk of the table and its sums); a narrow "
          "kernel built again on that finding is in "
          "[run16-one-h200](../run16-one-h200/README.md).\n")
    print("## Stream priority and short CTAs\n")
    print("The GEMMs on the device's highest stream priority (`--gemm-priority high`) or "
          "the default, the accumulate on 66 persistent CTAs or one short CTA per tile "
          "(`TIDE_ACCUM_CTAS=100000`: the grid is the tile count), "
          "`mpirun -n 1 python -m tidearray.bench interference --impls tide`, at `63a81b4`:\n")
    print(grouped([(f"priority/ctas{c}-{p}.jsonl", f"{'66 CTAs' if c == 66 else 'a CTA per tile'}, "
                    f"GEMM priority {p}") for c in (66, 100000) for p in ("default", "high")],
                  "accumulate grid, GEMM stream"), end="\n\n")
    print("Then (`c95989f`) the accumulate kernel runs what is left of a tile after its "
          "full unroll 4 and then 2 vector steps at a time, not one at a time, so a tile of "
          "8,192 elements (4 steps per thread) keeps several loads in flight. The same "
          "commands, launched in turn (at one rank the accumulate has one source; between two "
          "GPUs, two, and the same change applies):\n")
    print(grouped([(f"priority-short/ctas{c}-{p}.jsonl",
                    f"{'66 CTAs' if c == 66 else 'a CTA per tile'}, GEMM priority {p}")
                   for c, p in ((66, "default"), (100000, "default"), (100000, "high"))],
                  "accumulate grid, GEMM stream"), end="\n\n")
    print("A persistent CTA holds its SM for the whole launch, so priority changes nothing "
          "at 66 CTAs. With a CTA per tile, SMs free up between tiles, and the block "
          "scheduler gives them to the higher-priority GEMM: half the slowdown. At the "
          "default priority the same short CTAs slow the GEMM most. Short CTAs cost the "
          "accumulate itself 768-800 us against 483-533 us on 66 CTAs, until the short "
          "tile kept its loads in flight: then 490-528 us against 477 us. "
          "Whether this holds "
          "between two GPUs, where the accumulate runs beside the copy engines, is what "
          "`TIDE_GPU_STEPS=priority bash tests/gpu/run.sh` measures on 2xH200.")


main()
