"""This page, from the records here (run from the repo root):

    python docs/benchmarks/run13-issue/report.py > docs/benchmarks/run13-issue/README.md

All records are from nvidia-h200 (one H200): development figures.
"""
import os
import re

HERE = "docs/benchmarks/run13-issue"
PROBE = "issue_probe-a95742c.txt"
#: host_profile.py records of Qwen3's unit, two ranks sharing the GPU: (record, own copy as).
PROFILES = [("host_profile-qwen3-driver-97cc40e.txt", "the driver's batch "
             "(`TIDE_LOCAL_COPY_KERNEL_MIN=0`)"),
            ("host_profile-qwen3-kernel-97cc40e.txt", "one copy kernel, 16 CTAs (the default "
             "then; a quarter of the SMs since)")]
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


def profile_table(records, what):
    out = [f"| {what} | call device (us) | call host (us) | own copies alone, host (us) |",
           "| --- | ---: | ---: | ---: |"]
    for name, label in records:
        r = rows(name)
        own = r.get("own batch", (None, None))[1]
        out.append(f"| {label} ([{name}]({name})) | {r['call'][0]:,.0f} | {r['call'][1]:,.0f} "
                   f"| {'-' if own is None else f'{own:,.0f}'} |")
    return "\n".join(out)


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
  copy engines, and needs 822 us on 33 CTAs for the 1,597 us the pushes take there;
  the next 2xH200 run times it. `TIDE_LOCAL_COPY_KERNEL_MIN=0` restores the driver's
  batch.

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
