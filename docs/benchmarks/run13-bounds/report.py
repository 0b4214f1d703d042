"""This page, from the records here (run from the repo root):

    python docs/benchmarks/run13-bounds/report.py > docs/benchmarks/run13-bounds/README.md

Each record is the JSON that ``mpirun -n 2 python tests/gpu/hw_bounds.py RECORD`` wrote on
nvidia-h200-x2 (``TIDE_GPU_STEPS=bounds bash tests/gpu/run.sh``).
"""
import glob
import json
import os

HERE = "docs/benchmarks/run13-bounds"
#: The records the conclusions quote (rates, GEMMs); every record is listed below them.
RATES = "hw_bounds-6472342.json"
GEMMS = "hw_bounds-9c75d40.json"
NOTES = {
    "hw_bounds-6472342.json": "the earlier accumulate; the GEMM rows without the pieces",
    "hw_bounds-9c75d40.json": ("a trial `vector` kernel (eight elements per step, eight "
                               "steps per thread, each stored as it lands), reverted: "
                               "slower"),
    "hw_bounds-2122283.json": "the earlier accumulate, with the pair probe",
}


def load(name):
    with open(os.path.join(HERE, name)) as f:
        return json.load(f)


def rate_table(rec):
    grids = list(next(iter(rec["rates"].values())))
    out = ["| GB/s per CTA, grid (CTAs) | " + " | ".join(grids) + " |",
           "| --- |" + " ---: |" * len(grids)]
    for name, per in rec["rates"].items():
        out.append(f"| {name} | " + " | ".join(f"{per[g] / 1e9:.1f}" for g in grids) + " |")
    return "\n".join(out)


def gemm_table(rec):
    out = ["| beside | collective alone (us) | single-wave GEMM slowdown (median) | pairs |",
           "| --- | ---: | ---: | --- |"]
    for name, r in rec["gemm_beside"].items():
        pairs = ", ".join(f"{s * 100:+.1f}%" for s in r["slowdowns"])
        out.append(f"| {name} | {r['collective_us']:.1f} | {r['median'] * 100:+.1f}% | {pairs} |")
    return "\n".join(out)


def best(rec, names):
    return max(max(rec["rates"][n].values()) for n in names if n in rec["rates"])


def main():
    m, gm = load(RATES), load(GEMMS)
    nbytes, stock, sms = m["accumulate_bytes"], m["stock_sm_time_s"], m["device"]["sms"]
    acc = best(m, ("accumulate (vector)", "accumulate (bulk)"))
    probe = best(m, ("copy probe", "pair probe"))
    need = nbytes / (sms * stock / 12.5)
    g = gm["gemm_beside"]

    def slow(name):
        return f"{g[name]['median'] * 100:+.1f}%"

    def floor(rate):
        return nbytes / (sms * rate)

    print(f"""# What the hardware leaves for two goals (2xH200)

Machine: `nvidia-h200-x2`. Command: `mpirun -n 2 python tests/gpu/hw_bounds.py RECORD`
(`TIDE_GPU_STEPS=bounds bash tests/gpu/run.sh`), on an otherwise idle pair of GPUs. This
page is made from the records here by `python {HERE}/report.py`. The streaming rates
quoted are from `{RATES}` (commit `{m['commit']}`), the GEMM figures from `{GEMMS}`
(commit `{gm['commit']}`, whose all-gather code is the shipped one).

## RS SM time: the goal is past what one SM can stream

CUPTI's SM time of a kernel is `duration x CTAs / SMs`, so for a kernel that streams
its bytes it is those bytes over the rate one CTA moves them at, divided by the SMs
({sms}). The accumulate is TIDE-RS's only kernel; on the Llama-3.1-8B unit it moves
{nbytes / 1e6:.0f} MB per rank (two bf16 sources read, one fp32 sum written per
element). `stock`'s SM time there is {stock * 1e6:.1f} us (run 11, CUPTI), so 12.5x
below it is {stock / 12.5 * 1e6:.1f} us, which needs {need / 1e9:.1f} GB/s per CTA.

- No kernel with this read/write mix streams that fast on one SM. The copy probe
  (16-byte streaming loads and stores, eight loads in flight per thread, 1,024 threads
  per CTA) reaches at most {probe / 1e9:.1f} GB/s per CTA. That is an SM time of at
  least {floor(probe) * 1e6:.1f} us, {stock / floor(probe):.1f}x below `stock`'s. Only
  reading, with nothing written, goes faster (the read probe). So 12.5x is out of reach
  of any kernel that moves these bytes on the SMs of an H200.
- The accumulate measured here streamed at most {acc / 1e9:.1f} GB/s per CTA: an SM
  time of at least {floor(acc) * 1e6:.1f} us, {stock / floor(acc):.1f}x below `stock`'s.
  It read eight elements of each source per step, and each thread then stored 32 bytes
  as two 16-byte stores, so every store instruction of a warp wrote half of each
  32-byte sector it touched. A first trial that kept eight elements per step and only
  added steps in flight was slower (the `9c75d40` record) and was reverted.
- The shipped kernel (`98087c9`) steps four elements at a time, so each store covers
  whole sectors, and with two sources it sums and stores each step as its loads land.
  In development runs on the single-GPU machine it streamed about as fast as the copy
  probe. Its figures on `nvidia-h200-x2` (this page's machine) are not taken yet. The
  page will carry them as the next record here, from the same command.
- The rate per CTA falls as the grid grows past about 33 CTAs, where the HBM is
  shared. In TIDE-RS the copy engines use the HBM too, so its accumulate runs below
  these rates.

{rate_table(m)}

## A single-wave GEMM beside TIDE-AG: the pieces, not the protocol

The interference suite's single-wave GEMM (1024x2048x16384, bf16) beside bare
copy-engine copies of the Llama-3.1-8B unit's bytes, with no flags and no protocol,
and beside TIDE-AG. Alone-then-beside pairs, median of three.

- The push alone, the bound TIDE-AG is timed against: {slow('push (the bound)')}.
- The own copy alone: {slow('own copy')}. It is a local copy at HBM speed, so the GEMM
  runs at about half speed while it lasts.
- Both, each as one copy on its own stream (an out-of-place all-gather with nothing
  else): {slow('push + own copy')}, within the 10% goal.
- The same bytes, cut into TIDE-AG's per-parameter pieces (one batch per stream, still
  no flags): {slow('the same, as pieces')}.
- TIDE-AG: {slow('TIDE-AG')}; with its large pieces sent as single copies rather than
  in the batch: {slow('TIDE-AG, large pieces alone')}.

So what slows the GEMM past 10% is the per-parameter pieces, not the flags, the lanes or
the batch. Each parameter's rows go to their own offset in the full parameter, and that
is what makes the gather zero-copy. The one-copy variant that stays within 10% needs
each rank's share contiguous at its destination: a flat buffer and a copy-out, the
conversion TIDE-AG exists to remove.

{gemm_table(gm)}

## Every record here
""")
    for path in sorted(glob.glob(os.path.join(HERE, "hw_bounds-*.json"))):
        name = os.path.basename(path)
        rec = load(name)
        print(f"### `{name}`: commit `{rec['commit']}`, {NOTES.get(name, '')}\n")
        print(rate_table(rec) + "\n")
        print(gemm_table(rec) + "\n")


main()
