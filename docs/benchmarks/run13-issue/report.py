"""This page, from the records here (run from the repo root):

    python docs/benchmarks/run13-issue/report.py > docs/benchmarks/run13-issue/README.md

All records are from nvidia-h200 (one H200): development figures.
"""
import json
import os
import re

HERE = "docs/benchmarks/run13-issue"
PROBE = "issue_probe-a95742c.txt"
#: The same probe with a batch that asks the driver for a copy engine, and the rates.
FLAGGED = "issue_probe-6e4c0c0.txt"
#: host_profile.py records of Qwen3's unit, two ranks sharing the GPU: (record, own copy as).
PROFILES = [("host_profile-qwen3-driver-97cc40e.txt", "the driver's batch "
             "(`TIDE_LOCAL_COPY_KERNEL_MIN=0`)"),
            ("host_profile-qwen3-kernel-97cc40e.txt", "one copy kernel, 16 CTAs (the default "
             "then; a quarter of the SMs since)")]
#: The same, on nvidia-h200-x2: between two GPUs, one rank each.
PROFILES_X2 = [("host_profile-qwen3-driver-c184aa8-x2.txt", "the driver's batch "
                "(`TIDE_LOCAL_COPY_KERNEL_MIN=0`)"),
               ("host_profile-qwen3-kernel-c184aa8-x2.txt", "one copy kernel, 33 CTAs "
                "(the default)"),
               ("host_profile-qwen3-kernel-batch32-a5bd203-x2.txt", "the same, each peer's "
                "pushes in driver calls of 32 copies (`copy_batch_max`, at `a5bd203`)")]
#: The relayed push, tried and dropped: (record, settings at e07ffab).
RELAY = [("relay-2d-1-e07ffab.txt", "relayed, pushes from the slot as 2D copies"),
         ("relay-no2d-e07ffab.txt", "relayed, the same pushes as batch entries"),
         ("relay-off-e07ffab.txt", "not relayed"),
         ("relay-2d-2-e07ffab.txt", "relayed, as the first row, again")]
ROW = re.compile(r"^\s+(call|pre-issued|batch|own batch)\s+device\s+([\d.]+) us"
                 r".*host\s+([\d.]+) us")


def text(name):
    with open(os.path.join(HERE, name)) as f:
        return f.read()


def rows(name):
    out = {}
    for line in text(name).splitlines():
        m = ROW.match(line)
        if m and m.group(1) not in out:  # rank 0's
            out[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    return out


def probe_tables():
    lines = text(PROBE).splitlines()
    issue = [re.match(r"issue\s+(.+?)\s+393 copies.*: +(\d+) us", x) for x in lines]
    own = [re.match(r"own copy\s+(.+?):\s+(\d+) us\s+(\d+) GB/s", x) for x in lines]
    out = ["| 393 copies of 1 MiB, one batch | host time (us) |", "| --- | ---: |"]
    out += [f"| {m.group(1)} | {int(m.group(2)):,} |" for m in issue if m]
    out += ["", "| 393 copies of 1.5 MiB within the GPU, as | device time (us) | GB/s |",
            "| --- | ---: | ---: |"]
    out += [f"| {m.group(1)} | {int(m.group(2)):,} | {int(m.group(3)):,} |" for m in own if m]
    return "\n".join(out)


#: The record's labels for the hinted batch said where it was asked to run, not where it ran.
ASKED = {"copy engine": "whole, hint (on the SMs all the same)",
         "batch on a copy engine": "the same batch, with the hint"}


def flagged_tables():
    lines = text(FLAGGED).splitlines()
    issue = [re.match(r"issue\s+(.+?)(?:,| +393 copies of 1 MiB,) one batch: +(\d+) us", x)
             for x in lines]
    own = [re.match(r"own copy\s+(.+?):\s+(\d+) us\s+(\d+) GB/s", x) for x in lines]
    rate = [re.match(r"engine\s+(.+?)\s+(\d+) MB on (\d) stream\(s\), (.+?)\s*:\s+(\d+) us"
                     r"\s+(\d+) GB/s", x) for x in lines]
    out = ["| 393 copies of 1 MiB, one batch | host time (us) |", "| --- | ---: |"]
    out += [f"| {m.group(1)} | {int(m.group(2)):,} |" for m in issue if m]
    out += ["", "| 393 copies of 1.5 MiB within the GPU, as | device time (us) | GB/s |",
            "| --- | ---: | ---: |"]
    out += [f"| {ASKED.get(m.group(1), m.group(1))} | {int(m.group(2)):,} | "
            f"{int(m.group(3)):,} |" for m in own if m and "kernel" not in m.group(1)]
    out += ["", "| copies within the GPU | MB | streams | as | device time (us) | GB/s |",
            "| --- | ---: | ---: | --- | ---: | ---: |"]
    out += [f"| {m.group(1)} | {m.group(2)} | {m.group(3)} | {ASKED.get(m.group(4), m.group(4))} "
            f"| {int(m.group(5)):,} | {int(m.group(6)):,} |" for m in rate if m]
    return "\n".join(out)


def cut_cost():
    """The Llama-3.1-8B own copy on one stream, whole against cut, from ``FLAGGED``."""
    us = {}
    for x in text(FLAGGED).splitlines():
        m = re.match(r"engine\s+Llama.* on 1 stream\(s\), (.+?)\s*:\s+(\d+) us", x)
        if m:
            us[m.group(1)] = int(m.group(2))
    return f"{us['copy engine']} us whole against {us['SMs (driver, cut)']} us cut, here"


def gemm_cost():
    """The GEMM beside the own copy, cut against whole, from run13-bounds' record."""
    path = os.path.join(os.path.dirname(HERE), "run13-bounds", "hw_bounds-6e4c0c0-h200x1.json")
    with open(path) as f:
        own = json.load(f)["own_copy_beside"]
    cut = next(v for k, v in own.items() if "shipped" in k)["median"]
    whole = own["one copy per parameter, one batch"]["median"]
    return f"{cut * 100:+.1f}% against {whole * 100:+.1f}% for the whole copies"


def profile_table(records, what):
    out = [f"| {what} | call device (us) | call host (us) | own copies alone, host (us) |",
           "| --- | ---: | ---: | ---: |"]
    for name, label in records:
        r = rows(name)
        own = r.get("own batch", (None, None))[1]
        out.append(f"| {label} ([{name}]({name})) | {r['call'][0]:,.0f} | {r['call'][1]:,.0f} "
                   f"| {'-' if own is None else f'{own:,.0f}'} |")
    return "\n".join(out)


def x2_call(kind):
    return x2_row(kind, "call")


def x2_row(kind, row, col=0):
    name = next(n for n, _ in PROFILES_X2 if kind in n)
    return f"{rows(name)[row][col]:,.0f}"


def x2_own(kind):
    name = next(n for n, _ in PROFILES_X2 if kind in n)
    return f"{rows(name)['own batch'][1]:,.0f}"


def main():
    print(f"<!-- Generated: python {HERE}/report.py > {HERE}/README.md -->")
    print(f"""
# What copies cost to issue (development records, one H200)

Machine: `nvidia-h200`, one GPU. These are development figures: they say what the
driver costs the host, which does not depend on a second GPU, and how fast copies
within one GPU run; they do not show the gathers between GPUs.

## Issue cost, and the own copy by kernel

`python tests/gpu/issue_probe.py` (one process; [{PROBE}]({PROBE})):

{probe_tables()}

- A copy within the GPU costs the host about 3.8 us to issue, in a batch or not; a
  copy by copy engine almost nothing. So what bound Qwen3-30B-A3B's gather by its issue
  (393 parameters held as separate arrays) was its own copy, not its pushes.
- One launch of the copy kernel (`pack_bytes`, `kernels/pack.cu`) does the same copies
  with one call; on a quarter of the SMs (33 CTAs of 512 threads) in 822 us, against
  1,504 us for the driver's batch with its issue. The own copy of a cached batch of 64
  or more copies now goes that way (`local_copy_kernel_min`).

## Asking the driver for a copy engine

A copy batch can carry `CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE`, a hint to run its
copies beside kernels. The same probe, on a later machine, with that hint on the
copies within the GPU (`issue_probe.py`, [{FLAGGED}]({FLAGGED}); the copy kernel's
rows, as before, are in the record):

{flagged_tables()}

- With the hint the batch cost the host as much to issue, and took as long, as
  without it; issued while a kernel held every SM it waited for them
  ([run13-bounds](../run13-bounds/README.md)). On H200 (driver 580) the hint leaves
  copies within one GPU on the SMs, so it is no way around their issue cost or their
  SM time, and no batch of the library passes it.
- The record's labels said "copy engine" for what only asked for one; the tables
  here say what ran. Whole copies run faster than the same copies cut to 8 MiB
  (the Llama-3.1-8B unit's own copy: {cut_cost()}); the cut is what a
  concurrent GEMM needs ({gemm_cost()} in run13-bounds'
  record of the same commit), and the own copy runs beside the pushes, which take
  longer (563 us between two H200s in run 6), so the cut costs the gather nothing
  there. More streams helped the cut copies a little, so it stays one stream.
- This machine's issue costs were higher than in the first record (for the same
  393 copies within the GPU, host to device and device to host), so figures from
  different records are not compared here.

## Qwen3's gather, two ranks on one GPU

`TIDE_PROFILE_UNIT=qwen3-30b-a3b mpirun -n 2 python tests/gpu/host_profile.py`, the own
copy as each row says. Both ranks share the GPU, so their "pushes" are copies within it
too, issued at the same cost; between GPUs they run on copy engines.

{profile_table(PROFILES, "own copy as")}

- The kernel took the own copy's issue off the host (56 us against 1,501 us for the
  own copies alone), but here the call took longer on the device (7,354 against
  4,953 us). Both ranks are processes on one GPU, whose kernels (the driver's copies
  within the GPU among them) take turns on it; these records do not separate that
  from the kernel's own cost. Between GPUs the kernel runs beside the pushes on the
  copy engines, and needs 822 us on 33 CTAs for the 1,597 us the pushes take there
  (timed between GPUs below). `TIDE_LOCAL_COPY_KERNEL_MIN=0` restores the driver's
  batch.

## Qwen3's gather between two H200s

The same command on `nvidia-h200-x2` (two GPUs, one rank each), at `c184aa8`:

{profile_table(PROFILES_X2, "own copy as")}

- Between GPUs the copy kernel took the own copy's issue off the host
  (the own copies alone: {x2_own('kernel-c184')} us of host time, against
  {x2_own('driver')} us as the driver's batch) and the
  call's device time fell from {x2_call('driver')} to {x2_call('kernel-c184')} us. The call is
  no longer bound by its issue: its host time is now far below its device time.
- What was left came from issuing each peer's 393 pushes in one driver call: the
  copy engines start only when that call returns. Issued before the stream could
  start ("pre-issued" in the records), the same call took
  {x2_row('kernel-c184', 'pre-issued')} us on the device. With the pushes in calls of
  32 copies, the engines start on the first part while the host issues the rest: the
  call took {x2_call('batch32')} us on the device, against
  {x2_row('batch32', 'batch')} us for the pushes alone as one batch issued ahead. The
  host issues more calls ({x2_row('batch32', 'call', 1)} us of host time against
  {x2_row('kernel-c184', 'call', 1)} us), out of the device's way.

## Tried and dropped: a relayed push

Before the probe above, the pushes were taken to be the issue cost, and a relayed push
was tried: the own shards copied into the slot first, in parts, and each part pushed
from the slot as a few 2D copies. Same command, at `e07ffab` (`TIDE_AG_RELAY` then 1 or
0). It issued in less host time here, where its pushes were copies within the GPU, but
took longer on the device; between GPUs its pushes would cost the host almost nothing
either way, while waiting part by part for the own copy. So it was removed.

{profile_table(RELAY, "gather")}
""".rstrip())


if __name__ == "__main__":
    main()
