"""The accumulate kernels side by side, from the records here (run from the repo root):

    python docs/benchmarks/run10-accum/table.py > docs/benchmarks/run10-accum/table.md
"""
import glob
import json
import re

W = "llama3.1-8b"
rows = []
for path in sorted(glob.glob("docs/benchmarks/run10-accum/*.jsonl")):
    kernel, ctas = re.search(r"(\w+)-ctas(\d+)", path).groups()
    got, commit = {}, "?"
    for line in open(path):
        r = json.loads(line)
        if r.get("impl") == "tide" and r.get("workload") in (W, None):
            got[(r["suite"], r["metric"])] = r["value"]
        if r.get("metric") == "env":
            commit = r["extra"].get("commit", "?")[:7]
    rows.append((kernel, int(ctas), got, commit, path.split("/")[-1]))


def cell(v, scale, fmt):
    return "-" if v is None else format(v * scale, fmt)


def per_sm(g, ctas):
    """GB/s per CTA of the accumulate alone: the unit's 8 bytes per fp32 output element
    (two bf16 reads, one fp32 write) over its time and grid."""
    t = g.get(("rs", "phase:accumulate"))
    return None if t is None else 0.8724e9 / t / ctas / 1e9


print("| kernel | CTAs | RS time (us) | accumulate alone (us) | GB/s per CTA | RS SM time, "
      "CUPTI (us) | single-wave GEMM beside RS | commit | record |\n"
      "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
for kernel, ctas, g, commit, name in sorted(rows):
    print(f"| {kernel} | {ctas} | {cell(g.get(('rs', 'time')), 1e6, ',.0f')} | "
          f"{cell(g.get(('rs', 'phase:accumulate')), 1e6, ',.0f')} | "
          f"{cell(per_sm(g, ctas), 1, '.1f')} | "
          f"{cell(g.get(('rs', 'sm_time_cupti')), 1e6, ',.1f')} | "
          f"{cell(g.get(('interference', 'rs:gemm-1024x2048x16384')), 100, '+.1f')}% | "
          f"`{commit}` | {name} |")
