#!/usr/bin/env python3
"""The single test entry point: single-process tests, then the multi-rank suite.

Runs, in order, each in its own process group (every run starts, however long the ones
before it took: there is no total time limit):

1. ``python -m pytest -q tests``: every area's single-process tests (its folder's own
   ``test_*.py``): layout, config and helper tests (Hypothesis, 75 examples per property:
   ``SINGLE``), every python block of the docs (``docs/test_docs.py``, each under
   ``mpiexec -n 2``), and the benchmark harness's own tests; the ``mpi/`` and ``gpu/``
   tests there skip;
2. ``mpiexec -n N python -m pytest --with-mpi -q`` on every area's ``mpi/`` folder
   (``MPI_TESTS``) for N = 1, 2, 3, 4 (the library, then the harness and the baseline
   comms);
3. topology overrides: ``TIDE_LOCAL_SIZE=1`` with N = 2, 3 (pairwise inter-node
   steps) and 4 (recursive doubling), and ``TIDE_LOCAL_SIZE=2`` with N = 4 (two
   nodes of two ranks), that one in debug mode (``TIDE_DEBUG=1``: stamps checked);
   these runs leave out the framework front ends and the harness (``CORE_TESTS``: core
   and fsdp);
   then 8 ranks as 2 x 4 nodes, on the collectives and their pipelines
   (``WIDE_TESTS``; ``--no-wide`` skips it). These re-checks take 6
   Hypothesis examples per property (``AGAIN``), the plain runs 30 at 1-2 ranks
   (``PLAIN``) and 10 at 3-4 (``WIDER``); each CI run draws a new seed, so the runs
   together search further than any one;
4. every example under ``mpiexec -n 2`` (the trainer for 5 steps; the torch, JAX
   and interop examples too);
5. the benchmarks under ``mpiexec -n 2``: the step comparisons
   (``benchmarks/steps/``: the trainer under each comm, FSDP2 against
   ``shard_module``, ``tidearray.jax`` against unsharded JAX in float32) on a tiny
   model, and the harness on small sizes
   (``python -m benchmarks all --quick``), which exits nonzero if any step fails or
   any output is wrong.

The torch, Hugging Face and JAX tests and examples need the frameworks the ``test``
extra installs; without one, the script stops before any run (instead of letting
those tests skip and those examples fail).

Consecutive runs whose processes fit in the machine's cores together run at once (on
two cores: the single-process run beside ``mpi n=1``); the others one at a time.

Each run has a hang timeout, which no healthy run comes near: 20 minutes
(``--timeout S`` or ``TIDE_TEST_HANG_S``) times how many times over the cores are asked
for (the wave's processes or the 1-minute load average, whichever is higher, over the
cores; at least 1, and the highest seen while the run lasts). A run that reaches it is
killed and reported as a hang. ``TIDE_TIMEOUT`` (a host-backend wait) defaults to 60 s
here and ``TIDE_TEST_SKEW_S`` (the barrier after a test) to 120 s, both times the same
factor as the run starts, so a lost signal fails a test instead of hanging it, while a
busy machine does not.

Every run gets the same Hypothesis seed (printed; pass ``--seed`` to reproduce), so all
ranks of a run draw the same examples; it also seeds every test's fresh data (each draws
its seed through ``_util.fresh_seed``, and prints it). Prints a summary table; the exit
status is nonzero if any run failed or hung.

Usage: ``python tests/run.py [--seed S] [--only WORD] [--ranks 1,2] [-- PYTEST ARGS]``
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
#: A run's hang timeout before scaling (``hang_limit``). Healthy runs take 13-140 s on an
#: idle two-core machine; a slow or busy one may take several times that and must still
#: pass, so only a hang should come near this. ``--timeout`` or ``TIDE_TEST_HANG_S`` set it.
HANG_BASE_S = 20 * 60
#: ``TIDE_TIMEOUT`` and ``TIDE_TEST_SKEW_S`` before scaling: short enough that a lost signal
#: fails its test within minutes, far above a healthy wait on an idle machine. A peer's
#: lateness grows with contention as everything else does, so they scale like the hang limit.
WAIT_BASE_S = 60.0
SKEW_BASE_S = 120.0
#: Frameworks the ``test`` extra installs; the suite and the examples need every one.
FRAMEWORKS = ("torch", "transformers", "safetensors", "peft", "jax", "flax", "optax")


@dataclass(frozen=True)
class Load:
    """How many times over the cores are asked for while a run lasts: ``factor`` (at least
    1) and ``why``, the figures behind it, for the messages."""
    factor: float
    why: str


def contention(procs: int, cores: int) -> Load:
    """The wave's ``procs`` processes or the 1-minute load average, whichever is higher, over
    ``cores``. Not their sum: once a wave has run a while the load average counts its own
    processes (and for a while the previous wave's, which only makes the limit kinder)."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform: count our own processes only
        load = 0.0
    factor = max(1.0, max(procs, load) / cores)
    return Load(factor, f"{procs} processes, 1-min load {load:.1f}, {cores} cores")


def hang_limit(base: float, load: Load) -> float:
    """Seconds a run may take before it counts as hung: ``base`` times the contention."""
    return base * load.factor


@dataclass
class Run:
    name: str
    ranks: int  # 0: plain pytest, no mpiexec
    env: dict = field(default_factory=dict)
    status: str = "not run"
    seconds: float = 0.0
    summary: str = ""
    log: Optional[Path] = None
    #: Example scripts to run under mpiexec instead of pytest.
    scripts: tuple = ()
    #: pytest's paths and options for a multi-rank run.
    targets: tuple = ()
    #: The contention the run met, highest seen (it sets the hang limit; see ``Load``).
    load: Optional[Load] = None


#: The multi-rank tier: every area's ``mpi/`` folder, the library's, then the harness's
#: (a new area's ``mpi/`` goes here too).
MPI_TESTS = ("tests/core/mpi", "tests/fsdp/mpi", "tests/torch/mpi", "tests/jax/mpi",
             "tests/benchmarks/mpi")
#: The topology and debug runs re-run the layers that topology and stamps reach: the
#: collectives, plans, errors (core) and the runtime (fsdp). The torch front end and the
#: benchmark harness sit above the collectives and take no path of their own there, so
#: those runs leave them to the plain runs (which keeps CI well inside its budget).
CORE_TESTS = ("tests/core/mpi", "tests/fsdp/mpi")
#: tidearray.jax decides in its own calls whether the ranks replay a plan's graph or run
#: it eagerly, which debug mode constrains (a replay's stamps are its capture's): the
#: debug run takes its tests too.
DEBUG_TESTS = (*CORE_TESTS, "tests/jax/mpi")


#: The runs that re-check on another split or mode what the plain runs searched take
#: fewer Hypothesis examples per property (6; the plain runs at 1-2 ranks take 30).
AGAIN = {"TIDE_TEST_EXAMPLES": "6"}
#: The plain runs at 1 and 2 ranks.
PLAIN = {"TIDE_TEST_EXAMPLES": "30"}
#: The plain runs at 3 and 4 ranks, slower per example on CI's two cores: 10.
WIDER = {"TIDE_TEST_EXAMPLES": "10"}
#: The single-process run's planning properties: 75 examples each (150 outside CI).
SINGLE = {"TIDE_TEST_EXAMPLES": "75"}
#: Eight ranks as 2 x 4 nodes: the collectives and their inter-node pipelines, with four
#: ranks per node (eight processes share CI's two cores). Nodes of one rank and of two
#: are the 4-rank runs' 4 x 1 and 2 x 2.
WIDE_TESTS = ("tests/core/mpi/test_all_gather.py", "tests/core/mpi/test_reduce_scatter.py",
              "tests/core/mpi/test_pipeline.py")
WIDE, WIDE_LOCAL = 8, 4


def plan(ranks: list[int], wide: bool = True) -> list[Run]:
    runs = [Run("single-process", 0, SINGLE)]
    runs += [Run(f"mpi n={n}", n, PLAIN if n <= 2 else WIDER, targets=MPI_TESTS)
             for n in ranks]
    # (ranks, TIDE_LOCAL_SIZE, debug mode: plan order re-checked and every node-local
    # transfer's stamps checked, here with the inter-node pipelines around those copies)
    overrides = [(2, 1, False), (3, 1, False), (4, 1, False), (4, 2, True)]
    runs += [Run(f"mpi n={n} local_size={L}" + (" debug" if debug else ""), n,
                 {"TIDE_LOCAL_SIZE": str(L), **({"TIDE_DEBUG": "1"} if debug else {}), **AGAIN},
                 targets=DEBUG_TESTS if debug else CORE_TESTS)
             for n, L, debug in overrides if n in ranks]
    if wide:
        runs.append(Run(f"mpi n={WIDE} local_size={WIDE_LOCAL}", WIDE,
                        {"TIDE_LOCAL_SIZE": str(WIDE_LOCAL), **AGAIN}, targets=WIDE_TESTS))
    if 2 in ranks:
        runs.append(Run("examples n=2", 2, scripts=EXAMPLES))
        runs.append(Run("benchmarks n=2", 2, scripts=BENCHMARKS))
    return runs


def find_mpiexec() -> str:
    """``mpiexec`` next to this Python (a venv's mpich wheel), else on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        sys.exit("tests/run.py: no mpiexec next to the interpreter or on PATH "
                 "(pip install mpich, or install an MPI)")
    return found


def mpiexec_flags(mpiexec: str) -> list[str]:
    """Open MPI needs to be told to oversubscribe (and to run as root); MPICH does not."""
    try:
        version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    if "Open MPI" not in version and "OpenRTE" not in version:
        return []
    return ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])


#: Every example, as the docs run it (short settings where a flag allows).
EXAMPLES = (("examples/train.py", "--steps", "5"), ("examples/quickstart.py",),
            ("examples/async_prefetch.py",), ("examples/interop_dlpack.py",),
            ("examples/torch_train.py", "--micro-batches", "2"), ("examples/hf_train.py",),
            ("examples/hf_train.py", "--lora", "--steps", "6"),
            ("examples/jax_train.py", "--steps", "5"),
            ("examples/memory_plan.py",), ("examples/graph_plans.py",))
#: The benchmarks, on small settings: the step comparisons, then the harness.
BENCHMARKS = (("-m", "benchmarks.steps.compare_train", "--steps", "4"),
              ("-m", "benchmarks.steps.compare_fsdp2", "--steps", "4", "--interleave"),
              ("-m", "benchmarks.steps.jax_step", "--tiny", "--dtype", "float32", "--profile"),
              ("-m", "benchmarks", "all", "--quick", "--iters", "20", "--out",
               str(Path(tempfile.gettempdir()) / "tidearray-ci-bench")))


def command(run: Run, mpiexec: list[str], seed: int, extra: list[str]) -> list[str]:
    if run.scripts:  # one shell line: each example in turn, stopping at the first failure
        import shlex

        return ["sh", "-c", " && ".join(
            shlex.join(mpiexec + ["-n", str(run.ranks), sys.executable, *s])
            for s in run.scripts)]
    pytest = [sys.executable, "-m", "pytest", "-q", "--color=no", "-p", "no:cacheprovider",
              f"--hypothesis-seed={seed}"]
    if run.ranks == 0:
        return pytest + ["tests"] + extra
    return (mpiexec + ["-n", str(run.ranks)] + pytest
            + ["--with-mpi", *run.targets] + extra)


def waves(runs: list[Run], cores: int) -> list[list[Run]]:
    """Consecutive runs whose processes fit in ``cores`` together, to run at once (on CI's
    two cores: the single-process run beside the one-rank run); every other run alone."""
    out: list[list[Run]] = []
    for run in runs:
        if out and sum(max(r.ranks, 1) for r in out[-1]) + max(run.ranks, 1) <= cores:
            out[-1].append(run)
        else:
            out.append([run])
    return out


def start(run: Run, cmd: list[str], logdir: Path) -> tuple[subprocess.Popen, float]:
    """Start ``cmd`` in its own process group (so a timeout kills mpiexec and its ranks),
    writing to the run's log; returns the process and its start time. ``run.load`` is the
    contention as it starts."""
    # The in-test waits scale with the contention the run starts under; the variables
    # themselves, where set, win (the hang limit still scales).
    waits = {k: os.environ.get(k, f"{base * run.load.factor:.0f}")
             for k, base in (("TIDE_TIMEOUT", WAIT_BASE_S), ("TIDE_TEST_SKEW_S", SKEW_BASE_S))}
    env = dict(os.environ, **waits, **run.env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    run.log = logdir / (re.sub(r"[^\w]+", "_", run.name) + ".log")
    with open(run.log, "w") as log:
        log.write("$ " + " ".join(f"{k}={v}" for k, v in {**waits, **run.env}.items()) + " "
                  + " ".join(cmd) + "\n\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, time.monotonic()


def finish(wave: list[Run], started: list[tuple[subprocess.Popen, float]], base: float,
           cores: int) -> None:
    """Wait for a wave's processes, each until its hang limit (then kill its group): ``base``
    times the highest contention seen since it started, so load that comes mid-run counts
    too. Each run's time is its own, up to when it ended."""
    pending = dict(enumerate(wave))
    procs = sum(max(r.ranks, 1) for r in wave)
    try:
        while pending:
            now = time.monotonic()
            load = contention(procs, cores)
            for i, run in list(pending.items()):
                proc, t0 = started[i]
                if run.load is None or load.factor > run.load.factor:
                    run.load = load
                limit = hang_limit(base, run.load)
                rc = proc.poll()
                if rc is None and now < t0 + limit:
                    continue
                if rc is None:
                    run.status = f"TIMEOUT (hang, {limit:.0f} s)"
                    run.summary = (f"hang timeout {limit:.0f} s = {base:.0f} s x "
                                   f"{run.load.factor:.2f} (highest contention seen: "
                                   f"{run.load.why}); --timeout S or TIDE_TEST_HANG_S=S "
                                   "sets the base")
                    _kill(proc)
                else:
                    run.status = "passed" if rc == 0 else f"FAILED (exit {rc})"
                    run.summary = _pytest_summary(run.log.read_text(errors="replace"))
                run.seconds = time.monotonic() - t0
                del pending[i]
            time.sleep(0.2)
    except KeyboardInterrupt:
        for proc, _ in started:
            _kill(proc)
        raise


def _kill(proc: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _pytest_summary(text: str) -> str:
    """The last "N passed, M skipped in Ts" line (rank 0's, or any rank's)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # in case colour was forced (FORCE_COLOR)
    lines = re.findall(r"(\d+ (?:passed|failed|error|errors|skipped|xfailed|xpassed|deselected)"
                       r"(?:, \d+ \w+)*) in [\d.]+s", text)
    return lines[-1] if lines else ""


def report(runs: list[Run], seed: int, logdir: Path) -> None:
    rows = [("run", "ranks", "env", "status", "time", "tests")]
    for r in runs:
        env = " ".join(f"{k}={v}" for k, v in r.env.items()) or "-"
        rows.append((r.name, str(r.ranks or 1), env, r.status,
                     f"{r.seconds:.1f} s" if r.status != "not run" else "-", r.summary))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print()
    for k, row in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if k == 0:
            print("  ".join("-" * w for w in widths))
    print(f"\nHypothesis seed {seed} (reproduce: python tests/run.py --seed {seed}); "
          f"logs in {logdir}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=None,
                    help="Hypothesis seed for every run (default: TIDE_TEST_SEED or random)")
    ap.add_argument("--ranks", default="1,2,3,4", help="world sizes (default 1,2,3,4)")
    ap.add_argument("--no-wide", action="store_true",
                    help=f"skip the {WIDE}-rank run (2 x {WIDE_LOCAL} nodes)")
    ap.add_argument("--only", default=None, help="run only the runs whose name contains this")
    ap.add_argument("--timeout", type=float,
                    default=float(os.environ.get("TIDE_TEST_HANG_S") or HANG_BASE_S),
                    help="a run's hang timeout in seconds before it is scaled by the "
                         "contention (default TIDE_TEST_HANG_S or %(default)g)")
    ap.add_argument("--logs", default=None, help="directory for the logs (default: a temp dir)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else int(
        os.environ.get("TIDE_TEST_SEED") or random.getrandbits(32))
    # The seed of the tests' fresh data too (``_util.fresh_seed``): one seed then
    # reproduces their data as well as Hypothesis's examples.
    os.environ["TIDE_TEST_SEED"] = str(seed)
    # ``python tests/run.py`` puts tests/ first on sys.path, where the front ends' tests
    # (tests/torch, tests/jax) would pass for the frameworks themselves.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    missing = [m for m in FRAMEWORKS if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"tests/run.py: {', '.join(missing)} not installed in {sys.prefix}; the torch, "
                 "Hugging Face and JAX tests and examples need them (pip install -e '.[test]')")
    runs = plan([int(n) for n in args.ranks.split(",") if n], wide=not args.no_wide)
    if args.only:
        runs = [r for r in runs if args.only in r.name]
    mpi = find_mpiexec()
    mpiexec = [mpi] + mpiexec_flags(mpi)
    logdir = Path(args.logs or tempfile.mkdtemp(prefix="tidearray-tests-"))
    logdir.mkdir(parents=True, exist_ok=True)
    print(f"tests/run.py: {len(runs)} runs, Hypothesis seed {seed}, {mpi}, logs in {logdir}")
    cores = os.cpu_count() or 1
    print(f"tests/run.py: no total time limit; each run's hang timeout is {args.timeout:.0f} s "
          f"times the contention (the wave's processes or the 1-min load average over the "
          f"{cores} cores, at least 1); --timeout S or TIDE_TEST_HANG_S=S sets the base")
    for wave in waves(runs, cores):
        started = []
        load = contention(sum(max(r.ranks, 1) for r in wave), cores)
        for run in wave:
            run.load = load
            cmd = command(run, mpiexec, seed, args.pytest_args)
            print(f"--> {run.name} (hang timeout {hang_limit(args.timeout, load):.0f} s, "
                  f"x{load.factor:.2f}: {load.why}): {' '.join(cmd)}", flush=True)
            started.append(start(run, cmd, logdir))
        finish(wave, started, args.timeout, cores)
        for run in wave:
            print(f"    {run.name}: {run.status} in {run.seconds:.1f} s {run.summary}", flush=True)
            if run.status != "passed":
                tail = run.log.read_text(errors="replace").splitlines()[-120:]
                print("    ---- last lines of the log ----\n" + "\n".join(tail), flush=True)
    report(runs, seed, logdir)
    return 0 if all(r.status == "passed" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
