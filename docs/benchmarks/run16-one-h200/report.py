"""This page, from the records here (run from the repo root):

    python docs/benchmarks/run16-one-h200/report.py > docs/benchmarks/run16-one-h200/README.md

Every record comes from one H200 (nvidia-h200): ``narrow-probe-*.json`` from
``python tests/gpu/narrow_probe.py`` (one process), ``footprints-*.json`` from
``tests/gpu/footprints.py``, ``interference-*.jsonl`` and ``rs-*.jsonl`` from
``TIDE_ACCUM_KERNEL=... mpirun -n 1 python -m tidearray.bench interference|rs`` (their
``run`` record gives the commit, argv and ``TIDE_*`` settings), ``narrow-sharing-*.json``
from ``python tests/gpu/narrow_sharing.py PAIRS RECORD.json`` (one process),
``narrow-sass-*.json`` from Nsight Compute's source page through
``tests/gpu/narrow_sass.py``. The file name ends in the commit of the code that ran.
"""
import json
import os

HERE = "docs/benchmarks/run16-one-h200"
GEMM = "gemm-1024x2048x16384"
#: What each probe run changed in the library's narrow kernel (or probed beside it).
CHANGES = {
    "a88f208": "first version: a contiguous run of tiles per CTA, cursor in shared memory",
    "aaa46f2": "the piece's source pointers copied into the cursor",
    "bd27dd6": "(probe only: the flat kernel on runs; library variants)",
    "83f23ab": "(probe only: library variants)",
    "33bdde7": "(probe only: the flat kernel touching shared memory)",
    "6080b67": "(probe only: cycle counters)",
    "ecc78fc": "a chunk summed with the source count as a constant (1, 2, 4, 8)",
    "3c97ef1": "and with the chunk's steps as a constant (1 and 2 sources)",
    "9fe819f": "(the same kernel; four and eight sources probed)",
    "1c86ddc": "(the kernel as shipped from d0175d1, re-run)",
    "d7d9d83": "the source count and the scale flag as constants through the kernel",
}
ORDER = list(CHANGES)


def probe(commit):
    return json.load(open(os.path.join(HERE, f"narrow-probe-{commit}.json")))


def row(rec, sources, *names):
    for r in rec["rows"]:
        if r["sources"] == sources and r["kernel"] in names:
            return r
    return None


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def timing(r):
    if r is None:
        return ["-"] * 3
    slow = r.get("gemm_slowdown")
    return [f"{r['time_s'] * 1e6:,.0f}", f"{r['per_sm_elems_per_ns']:.2f}",
            "-" if slow is None else f"{slow * 100:+.1f}%"]


LIBRARY = ("narrow (library)", "narrow (library, as shipped)")


def footprints():
    fp = json.load(open(os.path.join(HERE, "footprints-9fe819f.json")))
    fits = {f["kernel"]: f for f in fp["fits"] if f["gemm"] == GEMM}
    g = fp["gemms"][GEMM]
    rows = [[f"`{n}`", k["threads"], k["registers"], f"{k['shared_bytes'] / 1024:.1f} KiB",
             k.get("local_bytes", "-"),
             "fits" if fits[n]["fits"] else "no (" + ", ".join(fits[n]["short_of"]) + ")"]
            for n, k in fp["ours"].items()]
    return ("## Which of tidearray's CTAs fit beside the GEMM's\n\n"
            f"`python tests/gpu/footprints.py` at `{fp['commit']}` "
            "([footprints-9fe819f.json](footprints-9fe819f.json)). The single-wave GEMM's "
            f"kernel `{g['name']}` runs {g['blocks']} CTAs of {g['threads']} threads at "
            f"{g['registers']} registers with {g['shared_bytes'] / 1024:.0f} KiB of shared "
            "memory; what its CTA leaves on an SM is 1,024 registers and about 19 KB.\n\n"
            + table(["kernel", "threads", "registers", "shared", "local bytes (spills)",
                     f"one CTA beside {GEMM}'s"], rows))


def by_commit():
    rows = []
    for c in ORDER:
        rec = probe(c)
        lib2, lib1 = row(rec, 2, *LIBRARY), row(rec, 1, *LIBRARY)
        flat = row(rec, 2, "narrow c2048x2")
        vec = row(rec, 2, "vector (library)", "vector (library default)")
        if lib2 is None:
            continue
        rows.append([f"`{c}`", CHANGES[c], *timing(lib2), lib2.get("local_bytes", "-"),
                     timing(lib1)[0], timing(flat)[0], *timing(vec)[::2]])
    return ("## The library's narrow kernel, commit by commit\n\n"
            "Each run times, in one process, the library's kernel on one piece of "
            f"{probe('9fe819f')['n']:,} elements per source (the Llama-3.1-8B unit's shard "
            "per rank at two ranks) and a flat kernel of the same shape that needs no piece "
            "table (`c2048x2`: two stages of 2,048 elements per source), against the "
            "library's vector kernel on its default grid (66 CTAs), then the single-wave "
            "GEMM beside each, looped (alone-then-beside pairs, the median of three). "
            "Rate: elements per ns per SM.\n\n"
            + table(["commit", "change", "narrow, 2 sources (us)", "rate", "GEMM beside",
                     "local bytes", "narrow, 1 source (us)", "flat c2048x2, 2 sources (us)",
                     "vector, 2 sources (us)", "GEMM beside vector"], rows))


def variants():
    rows = []
    for c in ("bd27dd6", "83f23ab", "33bdde7"):
        for r in probe(c)["rows"]:
            if r["sources"] == 2 and "narrow" in r["kernel"] and "time_s" in r:
                rows.append([f"`{c}`", r["kernel"], *timing(r)[:2],
                             r.get("registers", "-"), r.get("local_bytes", "-")])
    return ("## What did not explain the gap\n\n"
            "Two sources. The flat kernel on contiguous runs of chunks (`runs`, as the "
            "library walks tiles) or with lane 0 storing to or loading from shared memory "
            "around its copies (as the library's cursor does) kept its pace; the library's "
            "kernel without its register cap, with the proxy fence before the item's "
            "store, or with its walk inlined did not catch up (4 stages of 4 KB were "
            "slower).\n\n"
            + table(["commit", "kernel", "time (us)", "rate", "registers", "local bytes"], rows))


#: Nsight Compute's source page as records (tests/gpu/narrow_sass.py), by the commit
#: that ran: the narrow kernel of afefec9 (at 021c698) and of d7d9d83 (at 8ad7cbf).
SASS = ("021c698", "8ad7cbf")
SASS_FILES = ", ".join(f"[narrow-sass-{c}.json](narrow-sass-{c}.json)" for c in SASS)
NARROW_KERNEL = "tide_accumulate_bf16_narrow"


def sass(commit):
    return json.load(open(os.path.join(HERE, f"narrow-sass-{commit}.json")))


def ldc_per_item(rec):
    """Constant-bank loads on the narrow kernel's hot path, per item."""
    def opcode(text):
        words = text.split()
        return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]

    hot = rec["kernels"][NARROW_KERNEL]["hot"]
    return sum(n for text, n, _ in hot if opcode(text) == "LDC") / rec["items"]


def cycles():
    first, last = sass(SASS[0]), sass(SASS[1])
    ldc_before, ldc_after = ldc_per_item(first), ldc_per_item(last)
    before = first["kernels"][NARROW_KERNEL]["instructions_executed"]
    after = last["kernels"][NARROW_KERNEL]["instructions_executed"]
    flat = last["kernels"]["narrow"]["instructions_executed"]
    rows = []
    for c in ("6080b67", "ecc78fc", "3c97ef1", "9fe819f", "d7d9d83"):
        for r in probe(c)["rows"]:
            if r["kernel"].startswith("cycles") and r["sources"] <= 2:
                rows.append([f"`{c}`", r["sources"], r["kernel"][8:], f"{r['items']:,}",
                             f"{r['wait']:,.0f}", f"{r['consume']:,.0f}",
                             f"{r['refill']:,.0f}"])
    return ("## Where lane 0's cycles go, per item\n\n"
            "`clock64()` counters edited into the kernels' text (so built without the "
            "register cap): waiting on the stage's barrier, consuming the stage, refilling "
            "it. The library's kernel never waits on its copies; it is bound by the "
            "consuming and the refill, where the flat kernel waits. Summing with the source "
            "count and the chunk's steps as constants cut consuming from 2,404 to about "
            "1,140 cycles at two sources. Nsight Compute's source page then showed the "
            "scale, a kernel argument multiplied in under a run-time flag, loaded from the "
            f"constant bank (`LDC`) {ldc_before:.0f} times per item at `021c698`; with the "
            "flag and the source count as constants through the kernel (`d7d9d83`, run at "
            "`8ad7cbf`), "
            f"{ldc_after:.0f} times, and consuming fell to "
            f"{cyc('d7d9d83', 2, 'consume'):,.0f} cycles and refilling to "
            f"{cyc('d7d9d83', 2, 'refill'):,.0f}. Instructions executed per launch at two "
            f"sources: {before / 1e6:.1f}M before, {after / 1e6:.1f}M after, the flat "
            f"kernel's {flat / 1e6:.1f}M ({SASS_FILES}).\n\n"
            + table(["commit", "sources", "kernel", "items", "wait", "consume", "refill"], rows))


def cyc(commit, sources, part):
    """Lane 0's cycles per item of the library kernel in a probe record."""
    return row(probe(commit), sources, "cycles: library")[part]


def outliers():
    """Alone-then-beside pairs of a narrow kernel that fits beside the GEMM (at most 32
    registers), one or two sources, in which the GEMM slowed by more than 20%."""
    rows, total, sets = [], {"library": 0, "flat": 0}, {"library": 0, "flat": 0}
    for c in ORDER:
        for r in probe(c)["rows"]:
            if ("narrow" not in r["kernel"] or r.get("registers", 99) > 32
                    or r["sources"] > 2 or not r.get("gemm_slowdowns")):
                continue
            kind = "library" if "library" in r["kernel"] else "flat"
            total[kind] += len(r["gemm_slowdowns"])
            sets[kind] += 1
            if max(r["gemm_slowdowns"]) > 0.2:
                rows.append([f"`{c}`", r["sources"], r["kernel"], ", ".join(
                    f"{v * 100:+.1f}%" for v in r["gemm_slowdowns"])])
    bad = sum(p.count("%") - sum(1 for v in p.split(", ") if float(v[:-1]) <= 20)
              for *_, p in rows)
    return ("## Pairs in which the GEMM did not share the SMs\n\n"
            f"Beside the library's narrow kernel (built to fit beside the GEMM's CTA), "
            f"{len(rows)} of {sets['library']} sets of alone-then-beside pairs held a pair in "
            f"which the GEMM slowed by 35-91% ({bad} of {total['library']} pairs), about as "
            "much as beside a kernel that does not fit; beside the flat kernel, none of "
            f"{total['flat']} pairs. CUPTI's groups at `9fe819f` (the last table) had the "
            "GEMMs beside the accumulate within 2% of alone. Not explained: two narrow CTAs "
            "on one SM, where a GEMM's CTA no longer fits, do not tell the slow pairs from "
            "the others (next section). The 2xH200 run of `TIDE_GPU_STEPS=narrow` records "
            "three pairs per launch in two launches per kernel.\n\n"
            + table(["commit", "sources", "kernel", "pairs"], rows))


#: The library kernel in each narrow_sharing record: what it was.
_LEAVES = "claimed runs; a CTA beside another leaves; {} per working"
SHARING = {
    ("8cec908", "narrow (library)"): "static runs (the kernel as shipped)",
    ("6c58c29", "narrow (library)"): "static runs (the kernel as shipped)",
    ("d7d9d83", "narrow (library)"): "static runs, constants through the kernel (as shipped)",
    ("7810b95", "narrow (library)"): _LEAVES.format(2),
    ("6edb3e0", "narrow (library) x1"): _LEAVES.format(1),
    ("6edb3e0", "narrow (library) x2"): _LEAVES.format(2),
    ("da6723a", "library, static runs, all work x1"): "static runs, in the claiming code",
    ("da6723a", "library, claimed runs, all work x1"): "claimed runs; none leaves",
    ("da6723a", "library, as shipped x1"): _LEAVES.format(1),
    ("da6723a", "library, as shipped x2"): _LEAVES.format(2),
}


def sharing():
    """Per narrow_sharing record and kernel: the GEMM's slowdowns beside it, the SMs that
    held two of its CTAs at once, the kernel's time alone and beside the GEMM."""
    rows, pairs = [], []  # pairs: (commit, what, sources, row)
    for c in ("8cec908", "7810b95", "6edb3e0", "da6723a", "6c58c29", "d7d9d83"):
        rec = json.load(open(os.path.join(HERE, f"narrow-sharing-{c}.json")))
        groups = {}
        for r in rec["rows"]:
            groups.setdefault((r["sources"], r["kernel"]), []).append(r)
        for (n_src, kernel), rs in groups.items():
            what = SHARING.get((c, kernel), "flat (probe)" if "flat" in kernel else None)
            assert what, (c, kernel)
            pairs += [(c, what, n_src, r) for r in rs]
            slows = sorted(r["gemm_slowdown"] for r in rs)
            doubled = sorted(r["sms_doubled"] for r in rs)
            beside = sorted(r["beside_s"] for r in rs if "beside_s" in r)
            rows.append([f"`{c}`", n_src, what, len(rs),
                         f"{slows[len(slows) // 2] * 100:+.1f}%",
                         f"{slows[0] * 100:+.1f}% .. {slows[-1] * 100:+.1f}%",
                         sum(v > 0.2 for v in slows), f"{doubled[0]}-{doubled[-1]}",
                         f"{rs[0]['time_s'] * 1e6:,.0f}",
                         f"{beside[len(beside) // 2] * 1e6:,.0f}" if beside else "-"])
    def pick(commit=None, start=""):
        return [(n, r) for c, w, n, r in pairs
                if (commit is None or c == commit) and w.startswith(start)]

    def span(xs, fmt="{:.1f}"):
        return f"{fmt.format(min(xs))}-{fmt.format(max(xs))}"

    shipped = pick("8cec908", "static")
    slow = [r for _, r in shipped if r["gemm_slowdown"] > 0.2]
    fast = [r for _, r in shipped if r["gemm_slowdown"] <= 0.2]
    static = pick("da6723a", "static")
    claimed = pick(None, "claimed")
    c_slow = [r["gemm_slowdown"] * 100 for _, r in claimed if r["gemm_slowdown"] > 0.2]
    s_beside = [r["beside_s"] * 1e3 for n, r in static if n == 2]
    s_alone = [r["time_s"] * 1e6 for n, r in static if n == 2][0]
    c_beside = [r["beside_s"] * 1e3 for n, r in claimed if n == 2 and "beside_s" in r]
    every = "Every" if min(r["sms_doubled"] for *_, r in pairs) else "Most"
    return ("## Two narrow CTAs on one SM?\n\n"
            "One narrow CTA fits beside a GEMM's CTA; two do not. "
            "`tests/gpu/narrow_sharing.py` counts, per SM, the most CTAs of the kernel "
            "resident at once during each alone-then-beside pair (counters edited into the "
            f"kernel's text, so it runs slower than as shipped). {every} pair had SMs that "
            f"held two or more (up to {max(r['peak'] for *_, r in pairs)} on one SM), beside "
            "the flat kernel as well: the block scheduler does put several on one SM. But "
            "that does not tell the slow pairs. At "
            f"`8cec908` the {len(slow)} pairs in which the GEMM slowed by "
            f"{span([r['gemm_slowdown'] * 100 for r in slow], '{:.0f}')}% had "
            f"{span([r['sms_doubled'] for r in slow], '{}')} SMs doubled, while the other "
            f"{len(fast)} had up to {max(r['sms_doubled'] for r in fast)} doubled at "
            f"+{span([r['gemm_slowdown'] * 100 for r in fast])}%; at `da6723a` the "
            f"static-runs kernel had {span([r['sms_doubled'] for _, r in static], '{}')} "
            f"doubled over {len(static)} pairs, and the GEMM was within "
            f"+{max(r['gemm_slowdown'] for _, r in static) * 100:.1f}% in every one.\n\n"
            "A fix for doubling was tried and dropped (`7810b95` to `da6723a`): CTAs claim "
            "runs of tiles from a counter, and a CTA that finds another of its launch on its "
            f"SM leaves at once. Beside it the GEMM slowed by {span(c_slow, '{:.0f}')}% in "
            f"{len(c_slow)} of {len(claimed)} pairs, with or without leaving, at one or two "
            "CTAs launched per working one; the same code giving each CTA a static run did "
            "not (the `da6723a` rows). Where the GEMM ran slow, the accumulate beside it "
            "ran faster: at two sources the static-runs kernel took "
            f"{span(s_beside)} ms beside the GEMM ({s_alone:,.0f} us alone), the claiming "
            f"ones {span(c_beside)} ms. "
            "The shipped kernel keeps its static runs (`afefec9`). What sends a pair into "
            "one state or the other is not explained.\n\n"
            + table(["commit", "sources", "kernel", "pairs", "GEMM beside (median)",
                     "range", "pairs > +20%", "SMs doubled", "alone (us)",
                     "beside GEMM (us, median)"], rows))


def sources():
    rec = probe("9fe819f")
    rows = []
    for n in (4, 8):
        for name in ("vector (library)", "narrow (library, as shipped)"):
            r = row(rec, n, name)
            rows.append([n, name, *timing(r)])
    return ("## Four and eight sources\n\n"
            "At `9fe819f` the narrow kernel took any source count up to 16; each source's "
            "part of an 8 KB stage is then 2 or 1 KB. It fell far behind the vector kernel "
            "(and the GEMM beside it slowed by 82-154% in two of three pairs at four sources "
            "and in all three at eight), so from "
            "`4b858c8` the "
            "narrow kernel takes one or two sources and a launch with more uses the vector "
            "kernel on its own grid (`d0175d1`; "
            "[narrow-probe-d0175d1.txt](narrow-probe-d0175d1.txt): four sources 448 us, as "
            "the vector kernel's 448).\n\n"
            + table(["sources", "kernel", "time (us)", "rate", "GEMM beside"], rows))


def bench(name):
    settings, recs = {}, {}
    for line in open(os.path.join(HERE, name)):
        r = json.loads(line)
        if r["suite"] == "run":
            settings = r["extra"]
        elif r["impl"] == "tide" and r["status"] == "ok":
            recs[(r["workload"], r["metric"])] = r
    return settings, recs


def one_rank():
    rows = []
    for commit, kernel in ONE_RANK:
        _, ir = bench(f"interference-{kernel}-{commit}.jsonl")
        _, rr = bench(f"rs-{kernel}-{commit}.jsonl")
        i = ir[("llama3.1-8b", f"rs:{GEMM}")]
        ex = i["extra"]
        held = (ex.get("cupti") or {}).get("held", {})
        rows.append([f"`{commit}`", kernel, f"{ex['alone_s'] * 1e6:.1f}",
                     f"{ex['under_s'] * 1e6:.1f}",
                     f"{i['value'] * 100:+.1f}%",
                     "-" if not held.get("median_us") else f"{held['median_us']:.1f}",
                     f"{ex['collective_alone_s'] * 1e6:,.0f}",
                     *(f"{rr[(u, 'time')]['value'] * 1e6:,.0f}"
                       for u in ("llama3.1-8b", "llama3.1-70b", "qwen3-30b-a3b", "wan2.2-dit")),
                     f"{rr[('llama3.1-8b', 'sm_time_cupti')]['value'] * 1e6:,.0f}"])
    return ("## TIDE-RS and the GEMM beside it, at one rank\n\n"
            "`TIDE_ACCUM_KERNEL=vector|narrow mpirun -n 1 python -m tidearray.bench "
            "interference --impls tide` and `... rs --impls tide,stock --workloads units`, "
            "at each commit, launched in turn (`TIDE_GPU_STEPS=narrow TIDE_NARROW_RANKS=1 "
            "TIDE_NARROW_ROUNDS=1 bash tests/gpu/run.sh`). At one rank TIDE-RS is its "
            "accumulate of one source, with no copy engines and no peer. SM time is CUPTI's "
            "(duration x CTAs / SMs), which counts a CTA of one warp as a whole SM.\n\n"
            + table(["commit", "accumulate", "GEMM alone (us)", "beside TIDE-RS (us)", "slowdown",
                     "CUPTI: GEMMs held (us)", "TIDE-RS alone in that run (us)",
                     "TIDE-RS 8B (us)", "70B", "Qwen3", "Wan2.2", "SM time 8B (us)"], rows))


#: (commit, accumulate) of the one-rank interference and reduce-scatter records.
ONE_RANK = (("9fe819f", "vector"), ("9fe819f", "narrow"), ("d7d9d83", "vector"),
            ("d7d9d83", "narrow"))


def bench_impl():
    rows = []
    for line in open(os.path.join(HERE, "interference-tide-narrow-fff5adc.jsonl")):
        r = json.loads(line)
        if r["suite"] != "interference" or r["metric"] != f"rs:{GEMM}" or r["status"] != "ok":
            continue
        ex, cu = r["extra"], r["extra"].get("cupti") or {}

        def grp(name, cu=cu):
            g = cu.get(name) or {}
            return "-" if not g.get("median_us") else f"{g['median_us']:.1f} ({g['n']})"

        rows.append([r["impl"], f"{r['value'] * 100:+.1f}%",
                     ", ".join(f"{v * 100:+.1f}%" for v in ex["slowdowns"]), grp("alone"),
                     grp("clear"), grp("held"), f"{ex['collective_alone_s'] * 1e6:,.0f}"])
    return ("## The benchmark's `tide-narrow`\n\n"
            "`mpirun -n 1 python -m tidearray.bench interference --impls tide,tide-narrow` at "
            "`fff5adc` ([interference-tide-narrow-fff5adc.jsonl]"
            "(interference-tide-narrow-fff5adc.jsonl); `rs --impls tide,tide-narrow`: "
            "[rs-tide-narrow-fff5adc.jsonl](rs-tide-narrow-fff5adc.jsonl)). `tide-narrow` "
            "is TIDE-RS with the narrow accumulate in the same run as `tide`, so that the "
            "next 2xH200 `bench all` records both. In this run two of `tide`'s three pairs "
            "showed no slowdown; in the loop traced under CUPTI after the pairs, 24 of its "
            "GEMMs ran with none of the accumulate's kernels beside them. The timed slowdown "
            "counts a GEMM as beside "
            "the collective when it overlaps the collective's interval on its stream, which "
            "at one rank can be time before the accumulate's kernel starts; the CUPTI "
            "groups count the kernels themselves.\n\n"
            + table(["impl", "slowdown", "pairs", "CUPTI: alone", "clear", "held",
                     "TIDE-RS alone (us)"], rows))


def main():
    print("<!-- Generated: python docs/benchmarks/run16-one-h200/report.py > "
          "docs/benchmarks/run16-one-h200/README.md -->\n")
    print("# One H200: a narrow accumulate that shares every SM with a GEMM\n")
    print("Development screens on one GPU, not benchmark figures: one rank, so the "
          "accumulate has one or two local sources and no copy engines run beside it. They "
          "say what the kernel can do on an SM it shares with a GEMM; whether it keeps pace "
          "with the copy engines between two GPUs, and what the GEMM beside TIDE-RS then "
          "costs, are for `TIDE_GPU_STEPS=narrow bash tests/gpu/run.sh` on 2xH200.\n")
    print("The narrow kernel (`accum_kernel=\"narrow\"`, opt-in; "
          "`kernels/accumulate_narrow.cu`) is one warp per CTA at 32 registers with two "
          "8 KB stages of shared memory, one CTA per SM: it fits where a Hopper GEMM's CTA "
          "leaves room, so the GEMM's CTAs never wait for an SM it holds. Between two H200s "
          "it must keep pace with the copy engines: about 1.2 elements per ns per SM for "
          "the Llama-3.1-8B unit (run 14: 109M elements per rank in 711 us).\n")
    print("An earlier one-warp kernel (run15-one-h200, dropped) ran nine times slower than "
          "the vector kernel, and that page put it down to one warp's instruction issue. "
          "The flat probe below shows one warp per SM streaming two sources at 2.6 elements "
          "per ns per SM: the cost was in how that kernel walked the piece table, not in the "
          "one warp.\n")
    for part in (footprints, by_commit, variants, cycles, outliers, sharing, sources,
                 one_rank, bench_impl):
        print(part() + "\n")
    print("## Notes\n")
    print("- `narrow-probe-ecc78fc.json` has the vector kernel at eight sources "
          "\"bitwise False\": the probe timed before the default stream had finished making "
          "its sources (the kernels run on a non-blocking stream). From `3c97ef1` the "
          "probe synchronises first, and the vector kernel's eight-source bits are checked "
          "by `tests/gpu/test_cuda_engine.py` (passed on one H200 at `3c97ef1` and "
          "`d0175d1`).\n"
          "- `narrow-probe-83f23ab.json`'s commit was set by hand: the device's copy of "
          "`.git` was stale.\n"
          "- GPU tests of the narrow kernel at `d0175d1` on one H200: "
          "`tests/gpu/test_cuda_engine.py` and `test_cuda_tables.py` (accumulate, narrow "
          "and streamed cases) 109 passed at one rank; `TIDE_ACCUM_KERNEL=narrow` "
          "`tests/mpi/test_reduce_scatter.py` and `tests/gpu/test_cuda_units.py` 25 passed "
          "at two ranks sharing the GPU.\n"
          "- GPU tests of the narrow kernel at `afefec9` (the same kernel, its vector "
          "fallback cached, a relaunch test added), one H200: the same files and cases "
          "112 passed at one rank; `TIDE_ACCUM_KERNEL=narrow` reduce-scatter and units 25 "
          "passed at two ranks sharing the GPU. At `6c58c29`, `tests/` on the cuda backend: "
          "452 passed at one rank, 474 at two ranks sharing the GPU.\n"
          "- GPU tests of the narrow kernel at `d7d9d83`, one H200: the same files and cases "
          "112 passed at one rank; `TIDE_ACCUM_KERNEL=narrow` reduce-scatter and units 25 "
          "passed at two ranks sharing the GPU.\n"
          "- The Nsight Compute run behind `narrow-sass-021c698.json` launched the kernels "
          "from an uncommitted copy of `tests/gpu/narrow_sass.py`'s launcher (the same two "
          "launches); `narrow-sass-8ad7cbf.json` is the script's own run (the narrow "
          "kernel as at `d7d9d83`).\n"
          "- Until `1c86ddc` the probe stopped at four sources (dividing by zero counted "
          "items: those launches take the vector kernel), so `d0175d1`'s run is kept as "
          "its printout (`narrow-probe-d0175d1.txt`).")


if __name__ == "__main__":
    main()
