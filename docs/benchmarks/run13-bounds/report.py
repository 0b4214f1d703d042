"""This page, from the records here (run from the repo root):

    python docs/benchmarks/run13-bounds/report.py > docs/benchmarks/run13-bounds/README.md

Each record is the JSON that ``mpirun -n N python tests/gpu/hw_bounds.py RECORD`` wrote
(``TIDE_GPU_STEPS=bounds bash tests/gpu/run.sh``): on nvidia-h200-x2 with N = 2, unless
the record's ``gpus`` is 1 (nvidia-h200, one GPU, N = 1: development figures).
"""
import glob
import json
import os

HERE = "docs/benchmarks/run13-bounds"
#: The records the conclusions quote (rates, GEMMs); every record is listed below them.
RATES = "hw_bounds-c184aa8.json"
GEMMS = "hw_bounds-c184aa8.json"
#: The record of the earlier accumulate kernel, for its rate.
EARLIER = "hw_bounds-6472342.json"
#: The record the same-device copies section quotes.
HELD = "hw_bounds-afe172a-h200x1.json"
#: The record with a batch that asks the driver for a copy engine.
FLAGGED = "hw_bounds-6e4c0c0-h200x1.json"
NOTES = {
    "hw_bounds-6472342.json": "the earlier accumulate; the GEMM rows without the pieces",
    "hw_bounds-9c75d40.json": ("a trial `vector` kernel (eight elements per step, eight "
                               "steps per thread, each stored as it lands), reverted: "
                               "slower"),
    "hw_bounds-2122283.json": "the earlier accumulate, with the pair probe",
    "hw_bounds-8aaf12d-h200x1.json": ("one rank on one GPU: no peer, so no push and no "
                                      "gather; the same-device copies"),
    "hw_bounds-afe172a-h200x1.json": ("one rank on one GPU, as the record above, with the "
                                      "protocol's flags beside the held SMs"),
    "hw_bounds-c184aa8.json": ("the shipped accumulate and the own copy cut to 8 MiB: the "
                               "rates and GEMM figures quoted above"),
    "hw_bounds-6e4c0c0-h200x1.json": ("one rank on one GPU: the same-device copies again, "
                                      "with a batch that asks for a copy engine ("
                                      "`PREFER_OVERLAP_WITH_COMPUTE`; the rows that say \"on a "
                                      "copy engine\" only asked for one)"),
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


def slowdown_table(rows, what, alone):
    """The GEMM's slowdown beside each of ``rows`` (``hw_bounds.gemm_beside``'s rows)."""
    out = [f"| {what} | {alone} | single-wave GEMM slowdown (median) | pairs |",
           "| --- | ---: | ---: | --- |"]
    for name, r in rows.items():
        pairs = ", ".join(f"{s * 100:+.1f}%" for s in r["slowdowns"])
        out.append(f"| {name} | {r['collective_us']:.1f} | {r['median'] * 100:+.1f}% | {pairs} |")
    return "\n".join(out)


def gemm_table(rec):
    return slowdown_table(rec["gemm_beside"], "beside", "collective alone (us)")


def own_table(rec):
    return slowdown_table(rec["own_copy_beside"],
                          "the own copy (Llama-3.1-8B unit, one rank's share)", "copy alone (us)")


def held_table(rec):
    out = ["| copy (64 MiB) | alone (us) | issued while every SM is held (us) | "
           "SMs held for (ms) | |", "| --- | ---: | ---: | ---: | --- |"]
    for name, r in rec["held_sms"].items():
        out.append(f"| {name} | {r['alone_s'] * 1e6:.1f} | {r['beside_s'] * 1e6:.1f} | "
                   f"{r['held_s'] * 1e3:.1f} | "
                   f"{'waited for the SMs' if r['waited'] else 'ran beside'} |")
    return "\n".join(out)


def machine(rec):
    return ("nvidia-h200 (one GPU): development figures" if rec.get("gpus") == 1
            else "nvidia-h200-x2")


def best(rec, names):
    return max(max(rec["rates"][n].values()) for n in names if n in rec["rates"])


def held_section():
    """Which copies need the SMs, and the own copy's cut, from ``HELD``."""
    if HELD is None:
        return ""
    h = load(HELD)
    held, own = h["held_sms"], h["own_copy_beside"]
    ce = next(n for n in held if "host" in n)
    peer = [n for n in held if "peer" in n]
    mib = f"{h['local_copy_max'] >> 20} MiB"

    def slow(name):
        return f"{own[name]['median'] * 100:+.1f}%"

    def t(name):
        return f"{own[name]['collective_us']:.0f} us"
    names = list(own)
    one, per_param, twod, shipped = names[0], names[1], names[2], names[3]
    if peer:
        pr = held[peer[0]]
        peer_line = (f"A push into the peer's memory "
                     f"{'waited' if pr['waited'] else 'ran beside'} ({pr['beside_s'] * 1e6:.0f} "
                     f"us against {pr['alone_s'] * 1e6:.0f} us alone): copies between GPUs "
                     + ("need the SMs too." if pr["waited"] else "are the copy engines'."))
    else:
        peer_line = "This record has no peer, so the push was not measured here."
    flag = next((n for n in held if "flag" in n), None)
    if flag:
        peer_line += (" The protocol's flag write and wait (stream memory operations) "
                      + ("waited for the SMs too." if held[flag]["waited"] else
                         "ran beside the kernel: the handshake needs no SM."))
    return f"""## The own copy runs on the SMs

From `{HELD}` (commit `{h['commit']}`, {machine(h)}). Each copy was issued while a
kernel held every SM (two 1,024-thread CTAs per SM, for milliseconds). A copy-engine
copy, host to device, ran beside it ({held[ce]['beside_s'] * 1e6:.0f} us against
{held[ce]['alone_s'] * 1e6:.0f} us alone). Every copy within the device, whether one copy,
a batch or a 2D copy, waited until the kernel ended. So the driver runs a copy between
two buffers of one GPU on the SMs, and CUPTI reports it as a memcpy (`Memcpy DtoD`), not
a kernel. {peer_line}

{held_table(h)}

TIDE-AG's own copy (its shards into its own slot) is such a copy. Beside it alone, with
no peer and no protocol, the single-wave GEMM slowed by {slow(one)} with it as one copy,
{slow(per_param)} as one copy per parameter in one batch (what TIDE-AG issued),
{slow(twod)} with each parameter cut to {mib} and the cuts sent as 2D copies, and
{slow(shipped)} with the cuts in one batch, which took {t(shipped)} against {t(one)} as
one copy, a small part of the push's time. Same-device copies are now cut that way
(`local_copy_max`, {mib} by default) and never sent as 2D copies.

{own_table(h)}
"""


def flagged_section():
    """Whether asking the driver for a copy engine moves a same-device copy off the SMs."""
    f = load(FLAGGED)
    held, own = f["held_sms"], f["own_copy_beside"]
    asked = next(n for n in held if "engine" in n and "host" not in n)
    plain = next(n for n in held if "batch" in n)
    per_param = next(n for n in own if n.startswith("one copy per parameter, one batch"))
    flagged = next(n for n in own if "engine" in n)
    r = held[asked]

    def slow(name):
        return f"{own[name]['median'] * 100:+.1f}%"

    def pairs(name):
        return ", ".join(f"{x * 100:+.1f}%" for x in own[name]["slowdowns"])
    return f"""## Asking the driver for a copy engine does not move them

A copy batch can carry `CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE`, a hint to run
its copies beside kernels; NCCL's copy-engine collectives pass it. From `{FLAGGED}`
(commit `{f['commit']}`, {machine(f)}): the 64 MiB batch with the hint, issued while a
kernel held every SM, {'waited for the SMs' if r['waited'] else 'ran beside'}
({r['beside_s'] * 1e6:.0f} us, against {r['alone_s'] * 1e6:.0f} us alone; the same batch
without it: {held[plain]['beside_s'] * 1e6:.0f} us). The own copy as one copy per
parameter took {own[flagged]['collective_us']:.1f} us with the hint and
{own[per_param]['collective_us']:.1f} us without, and the single-wave GEMM beside it
slowed by {slow(flagged)} and {slow(per_param)} (pairs {pairs(flagged)}; {pairs(per_param)}):
the same copy on the SMs, within the spread of its pairs. On this GPU and driver the
hint changes nothing for copies within one GPU (it is documented for Tegra), so no
batch of the library passes it. The same record's rows are in its table below; its
issue cost and rates are in [run13-issue](../run13-issue/README.md).

"""


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

    old = best(load(EARLIER), ("accumulate (vector)",))
    print(f"""# What the hardware leaves for two goals (2xH200), and copies within a GPU

Machine: `nvidia-h200-x2`. Command: `mpirun -n 2 python tests/gpu/hw_bounds.py RECORD`
(`TIDE_GPU_STEPS=bounds bash tests/gpu/run.sh`), on an otherwise idle pair of GPUs; the
sections on copies within one GPU quote development records from `nvidia-h200` (one GPU,
`mpirun -n 1`), as each record below says. This page is made from the records here by
`python {HERE}/report.py`. The streaming rates and the GEMM figures quoted are from
`{RATES}` (commit `{m['commit']}`: the shipped accumulate, and the own copy cut into
`local_copy_max` pieces).

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
- The shipped accumulate (`98087c9`: four elements a step, so each store covers whole
  32-byte sectors, and with two sources each step summed and stored as its loads land)
  streamed at most {acc / 1e9:.1f} GB/s per CTA, about the copy probe's rate: an SM
  time of at least {floor(acc) * 1e6:.1f} us, {stock / floor(acc):.1f}x below `stock`'s.
  The earlier kernel reached {old / 1e9:.1f} GB/s per CTA (`{EARLIER}`): it read
  eight elements per step and stored them as two 16-byte stores per thread, so each
  store instruction of a warp wrote half of each sector it touched.
- The rate per CTA falls as the grid grows past about 33 CTAs, where the HBM is
  shared, and TIDE-RS runs its accumulate on half the SMs (66) by default, beside the
  copy engines' traffic. So its SM time in the suite stays well above this floor; fewer
  CTAs bring it closer, at a cost in speed and in a concurrent GEMM's time
  ([run14-sweeps](../run14-sweeps/README.md)).

{rate_table(m)}

## A single-wave GEMM beside TIDE-AG: the own copy's pieces

The interference suite's single-wave GEMM (1024x2048x16384, bf16) beside bare
copies of the Llama-3.1-8B unit's bytes, with no flags and no protocol,
and beside TIDE-AG. Alone-then-beside pairs, median of three.

- The push alone, the bound TIDE-AG is timed against: {slow('push (the bound)')}.
- The own copy alone, as one copy: {slow('own copy')}; cut into 8 MiB pieces in one
  batch, as TIDE-AG issues it: {slow('own copy, cut to 8 MiB')}.
- Push and own copy, each as one copy on its own stream: {slow('push + own copy')}.
- The same bytes as TIDE-AG's per-parameter pieces (one batch per stream, still no
  flags): {slow('the same, as pieces')}; with the own pieces cut to 8 MiB:
  {slow('the same, own pieces cut to 8 MiB')}.
- TIDE-AG: {slow('TIDE-AG')}; with its own copy left whole (one copy per parameter):
  {slow('TIDE-AG, own copy uncut')}; with its large pieces sent as single copies rather
  than in the batch: {slow('TIDE-AG, large pieces alone')}.

So the own copy's pieces decide it: cut to 8 MiB, TIDE-AG stays within the 10% goal;
whole, it does not. Why a copy within one GPU weighs on a GEMM at all is the next
section: it is not a copy-engine copy.

{gemm_table(gm)}

{held_section()}
{flagged_section()}## Every record here
""")
    for path in sorted(glob.glob(os.path.join(HERE, "hw_bounds-*.json"))):
        name = os.path.basename(path)
        rec = load(name)
        print(f"### `{name}`: commit `{rec['commit']}`, {machine(rec)}; "
              f"{NOTES.get(name, '')}\n")
        if rec.get("ranks", 2) >= 2:  # one rank's rates and floors count one rank's bytes
            print(rate_table(rec) + "\n")
        for key, table in (("gemm_beside", gemm_table), ("own_copy_beside", own_table),
                           ("held_sms", held_table)):
            if rec.get(key):
                print(table(rec) + "\n")


main()
