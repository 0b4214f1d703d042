"""This page, from the records here (run from the repo root):

    python docs/benchmarks/run13-relay/report.py > docs/benchmarks/run13-relay/README.md

Each record is what ``tests/gpu/host_profile.py`` printed for Qwen3-30B-A3B's unit, two
ranks on one GPU (nvidia-h200), at commit e07ffab (the library; the script's
``TIDE_PROFILE_NO_2D`` lines were committed with this page).
"""
import os
import re

HERE = "docs/benchmarks/run13-relay"
#: record -> (settings, what they mean), in run order.
RECORDS = {
    "relay-2d-1.txt": ("TIDE_AG_RELAY=1", "relayed, the pushes from the slot as 2D copies"),
    "relay-no2d.txt": ("TIDE_AG_RELAY=1 TIDE_PROFILE_NO_2D=1",
                       "relayed, the same pushes as batch entries"),
    "direct.txt": ("TIDE_AG_RELAY=0", "pushed straight from the shards (the default)"),
    "relay-2d-2.txt": ("TIDE_AG_RELAY=1", "relayed, as the first row, again"),
}
ROW = re.compile(r"^\s+(call|pre-issued|batch)\s+device\s+([\d.]+) us.*host\s+([\d.]+) us")


def rows(name):
    out = {}
    with open(os.path.join(HERE, name)) as f:
        for line in f:
            m = ROW.match(line)
            if m and m.group(1) not in out:  # rank 0's
                out[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    return out


def main():
    print(f"<!-- Generated: python {HERE}/report.py > {HERE}/README.md -->")
    print("""
# Relayed pushes on one GPU (development record)

Commit `e07ffab` (then `ag_relay` was a flag: 1 is today's `"on"`, 0 today's
`"off"`). Machine: `nvidia-h200`, one H200 shared by two ranks, so every copy, the "pushes"
included, is a copy within one GPU, which the driver runs on the SMs: these figures do
not show what a relay does between GPUs, where the pushes run on copy engines over
NVLink. Command, once per row (the settings before it):

```
TIDE_PROFILE_UNIT=qwen3-30b-a3b mpirun -n 2 python tests/gpu/host_profile.py
```

Rows: `call` is a plan call of the unit as the benchmark times it (host issue
included), its device time (the maximum over ranks) and rank 0's host time;
`pre-issued` is the same call behind a 2 ms spinning kernel; `batch` is the
unit's 393 direct pushes to the peer issued as one batch, with no flags (its host time:
what 393 copies cost to issue). Medians of 30 calls.
""")
    print("| settings | gather | call device (us) | call host (us) | pre-issued device (us) "
          "| 393 copies in one batch, host (us) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, (settings, what) in RECORDS.items():
        r = rows(name)
        print(f"| `{settings}` ([{name}]({name})) | {what} | {r['call'][0]:,.0f} | "
              f"{r['call'][1]:,.0f} | {r['pre-issued'][0]:,.0f} | {r['batch'][1]:,.0f} |")
    print("""
- Issuing a copy costs the host microseconds, whether alone or in a batch: the `batch`
  column, 393 copies, is 1.6-2.0 ms in every row.
- Relayed, the call issued in less host time (its pushes are 16 2D copies and the cut
  pieces, not 393 copies), but on this machine it took longer on the device, with the
  pushes as 2D copies or as batch entries alike. A relayed gather's pushes wait part by
  part for the own copy, and on this machine both run on the same SMs; which of the two
  costs the time was not measured. Between GPUs the pushes run on copy
  engines beside the own copy; that is what the `tide-relay` rows of
  `python -m tidearray.bench` measure, and why `ag_relay` is `"off"` by default until they
  are taken.""")


if __name__ == "__main__":
    main()
