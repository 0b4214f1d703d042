"""The accumulate-grid sweep's table, from the records here (run from the repo root):

    python docs/benchmarks/run9-ctas/table.py > docs/benchmarks/run9-ctas/table.md
"""
import glob
import json
import re

W = "llama3.1-8b"
rows = []
for path in sorted(glob.glob("docs/benchmarks/run9-ctas/*.jsonl")):
    ctas = int(re.search(r"ctas(\d+)", path).group(1))
    got = {}
    for line in open(path):
        r = json.loads(line)
        if r.get("impl") == "tide" and r.get("workload") == W:
            got[(r["suite"], r["metric"])] = r["value"]
        if r.get("metric") == "env":
            commit = r["extra"].get("commit", "?")[:7]
    rows.append((ctas, got, commit, path.split("/")[-1]))


def cell(v, scale, fmt):
    return "-" if v is None else format(v * scale, fmt)


print("| accumulate CTAs | RS time (us) | RS SM time, CUPTI (us) | single-wave GEMM beside "
      "RS | beside AG | commit | record |\n| ---: | ---: | ---: | ---: | ---: | --- | --- |")
for ctas, g, commit, name in sorted(rows):
    print(f"| {ctas} | {cell(g.get(('rs', 'time')), 1e6, ',.0f')} | "
          f"{cell(g.get(('rs', 'sm_time_cupti')), 1e6, ',.1f')} | "
          f"{cell(g.get(('interference', 'rs:gemm-1024x2048x16384')), 100, '+.1f')}% | "
          f"{cell(g.get(('interference', 'ag:gemm-1024x2048x16384')), 100, '+.1f')}% | "
          f"`{commit}` | {name} |")
