#!/usr/bin/env bash
# The GPU entry point: run on the GPU machine from the repo root.
#
#   bash tests/gpu/run.sh                      # the default steps: info np2 np1 nodes
#   TIDE_GPU_STEPS="np2 benchall" bash tests/gpu/run.sh  # some steps: info np2 np1 nodes
#                                                      # np3 np4 (ranks sharing GPUs)
#                                                      # benchall (python -m tidearray.bench all)
#                                                      # launches (benchall 3 times, one report)
#                                                      # ctas (TIDE-RS and GEMM interference at
#                                                      # each accumulate grid of TIDE_CTAS)
#                                                      # priority (the interference GEMMs at the
#                                                      # default and highest stream priority, at
#                                                      # each grid of TIDE_PRIO_CTAS)
#                                                      # jax (examples/jax_train.py on cuda)
#                                                      # plans, train (small model), train8b
#                                                      # (Llama-8B shape, tide/stock/local)
#                                                      # suites (each suite alone; TIDE_BENCH_SUITES)
#                                                      # faults (tests/test_faults.py on host and
#                                                      # cuda), soak (2,000 steps at 2 and 4 ranks),
#                                                      # debug (np2 with TIDE_DEBUG=1: stamps)
#                                                      # fsdp2 (examples/compare_fsdp2.py, Llama-8B
#                                                      # shape: FSDP2 vs shard_module vs the floor)
#                                                      # bounds (tests/gpu/hw_bounds.py: per-CTA
#                                                      # streaming rates, GEMM beside bare copies;
#                                                      # TIDE_BOUNDS_PARTS, TIDE_BOUNDS_RANKS)
#                                                      # calls (tests/gpu/call_profile.py: host
#                                                      # time of repeated calls, and cProfiles)
#                                                      # narrow (the narrow accumulate against
#                                                      # the default: probe, interference, RS)
#                                                      # footprints (tests/gpu/footprints.py: can
#                                                      # a GEMM's CTA and ours share an SM)
#   TIDE_GPU_PIPELINES="info np2 jax|np3 faults|np4 debug|nodes np1 soak" bash tests/gpu/run.sh
#                                              # those step lists side by side (correctness only)
#   TIDE_GPU_TIMEOUT=120 bash tests/gpu/run.sh # seconds per multi-rank command (300)
#   TIDE_MPI_ARGS="--bind-to none" bash tests/gpu/run.sh  # extra mpirun options
#   TIDE_GPU_TAR=run bash tests/gpu/run.sh     # $OUT bundled into $OUT/run.tgz at the end
#                                              # (reports left out: remade from the records)
#
# Installs the carried wheels (.whl/: nccl4py, pytest-mpi) into /tmp/site, then
# runs the generic suite (tests/) and the GPU tests (tests/gpu) on the cuda
# backend under mpirun -n 2 and -n 1, the GPU tests once more with
# TIDE_LOCAL_SIZE=1 (two emulated nodes: the NCCL path). Benchmarks: python -m tidearray.bench.
# Logs go to $OUT (or ./gpu-logs), step logs to $TIDE_GPU_LOGS if set. Every multi-rank command runs under timeout.
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-logs}
LOGS=${TIDE_GPU_LOGS:-$OUT}  # step logs (elsewhere, to keep few files under $OUT)
mkdir -p "$OUT" "$LOGS"
if [ ! -d /tmp/site/nccl ] && compgen -G ".whl/*.whl" > /dev/null; then  # once per machine
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
# Records name the commit; a copied tree's .git may be stale, so the launcher may set it.
export TIDE_GIT_COMMIT=${TIDE_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T=${TIDE_GPU_TIMEOUT:-300}
MPIRUN=(mpirun --allow-run-as-root --oversubscribe ${TIDE_MPI_ARGS:-} -x PYTHONPATH
        -x PYTHONUNBUFFERED -x XLA_PYTHON_CLIENT_PREALLOCATE -x TIDE_BACKEND=cuda)
for v in $(compgen -e | grep '^TIDE_'); do MPIRUN+=(-x "$v"); done  # settings reach every rank
MPI=(timeout "$T" "${MPIRUN[@]}")
PYTEST=(python3 -m pytest --with-mpi -q -p no:cacheprovider -o faulthandler_timeout=60 -rf)
status=0

step() {  # step NAME CMD...: run, log to $LOGS/NAME.log, remember failures
    local name=$1; shift
    echo "== $name: $*"
    local t0=$SECONDS
    "$@" 2>&1 | tee "$LOGS/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || status=1
}

run_info() { step info "${MPI[@]}" -n 2 python3 -m tidearray.info; }
run_np2() { step np2 "${MPI[@]}" -n "${TIDE_GPU_RANKS:-2}" "${PYTEST[@]}" tests; }
run_np1() { step np1 "${MPI[@]}" -n 1 "${PYTEST[@]}" tests; }
# Ranks sharing GPUs (rank -> device is local rank % count): correctness runs, not timings.
run_np3() { step np3 "${MPI[@]}" -n 3 "${PYTEST[@]}" tests/mpi tests/gpu; }
run_np4() { step np4 "${MPI[@]}" -n 4 "${PYTEST[@]}" tests/mpi tests/gpu; }
run_nodes() { step np2_nodes "${MPI[@]}" -x TIDE_LOCAL_SIZE=1 -n 2 "${PYTEST[@]}" tests/gpu; }
run_debug() { step np2_debug "${MPI[@]}" -x TIDE_DEBUG=1 -n 2 "${PYTEST[@]}" tests/mpi tests/gpu; }
run_faults() {  # starts its own mpiexec per case: not under mpirun
    step faults timeout "$T" python3 -m pytest -q -p no:cacheprovider -rf tests/test_faults.py; }
run_soak() {  # TIDE_SOAK_STEPS (2000); before/after figures in $OUT/soak.jsonl
    for n in 2 4; do
        step "soak_np$n" "${MPI[@]}" -x TIDE_SOAK_STEPS="${TIDE_SOAK_STEPS:-2000}" \
            -x TIDE_SOAK_REPORT="$OUT/soak.jsonl" -n "$n" "${PYTEST[@]}" tests/mpi/test_soak.py
    done
}
run_benchall() { step benchall "${MPI[@]}" -n 2 python3 -m tidearray.bench all \
    --out "$OUT/b" ${TIDE_BENCH_DOCS:+--docs "$TIDE_BENCH_DOCS"}; }
run_launches() {  # 3 separate launches, one report of the spread (TIDE_LAUNCH_SUITES: all;
    local jsons=()  # TIDE_LAUNCH_ARGS, e.g. "--workloads units", goes to each suite)
    for k in 1 2 3; do
        for suite in ${TIDE_LAUNCH_SUITES:-all}; do
            step "bench_${suite}_launch$k" "${MPI[@]}" -n 2 python3 -m tidearray.bench "$suite" \
                --out "$OUT/launch$k" ${TIDE_LAUNCH_ARGS:-}
        done
        jsons+=(--json "$OUT/launch$k/bench.jsonl")
    done
    step launches_report python3 -m tidearray.bench report "${jsons[@]}" --docs "$OUT/report3"
}
run_suites() {  # the same suites as benchall, each under its own timeout, one record file
    for suite in ${TIDE_BENCH_SUITES:-interference memory ag rs}; do
        step "bench_$suite" timeout "${TIDE_BENCH_TIMEOUT:-150}" "${MPIRUN[@]}" -n 2 \
            python3 -m tidearray.bench "$suite" --out "$OUT/b" ${TIDE_BENCH_ARGS:-}
    done
}
run_ctas() {  # TIDE-RS and the GEMM beside it at each accumulate grid (TIDE_CTAS;
              # TIDE_CTAS_IMPLS: the reduce-scatters timed beside tide's, e.g. tide,stock)
    for c in ${TIDE_CTAS:-66 33 16 8}; do
        step "rs_ctas$c" "${MPI[@]}" -x TIDE_ACCUM_CTAS="$c" -n 2 python3 -m tidearray.bench rs \
            --impls "${TIDE_CTAS_IMPLS:-tide}" --workloads units --out "$OUT/ctas$c"
        step "interference_ctas$c" "${MPI[@]}" -x TIDE_ACCUM_CTAS="$c" -n 2 python3 -m \
            tidearray.bench interference --impls tide --out "$OUT/ctas$c"
    done
}
run_priority() {  # the interference GEMMs at the default and the highest stream priority,
                  # beside the accumulate at each grid of TIDE_PRIO_CTAS (a grid past the
                  # tile count gives one short CTA per tile), TIDE_PRIO_ROUNDS rounds (2);
                  # then TIDE-RS there
    local k c p
    for k in $(seq "${TIDE_PRIO_ROUNDS:-2}"); do
        for c in ${TIDE_PRIO_CTAS:-66 100000}; do
            for p in default high; do
                step "interference_ctas${c}_${p}_$k" "${MPI[@]}" -x TIDE_ACCUM_CTAS="$c" -n 2 \
                    python3 -m tidearray.bench interference --impls tide --gemm-priority "$p" \
                    --out "$OUT/prio/ctas$c-$p-$k"
            done
        done
    done
    for c in ${TIDE_PRIO_CTAS:-66 100000}; do
        step "rs_ctas$c" "${MPI[@]}" -x TIDE_ACCUM_CTAS="$c" -n 2 python3 -m tidearray.bench rs \
            --impls tide,stock --workloads units --units llama3.1-8b --out "$OUT/prio/rs-ctas$c"
    done
}
run_narrow() {  # the narrow accumulate against the default: tests/gpu/narrow_probe.py (one
                # process), then the interference GEMMs (TIDE_NARROW_ROUNDS rounds, 2) and
                # TIDE-RS with each kernel, launched in turn, at TIDE_NARROW_RANKS ranks (2)
    local k a n=${TIDE_NARROW_RANKS:-2}
    step narrow_probe timeout "$T" python3 tests/gpu/narrow_probe.py "$OUT/narrow_probe.json"
    for k in $(seq "${TIDE_NARROW_ROUNDS:-2}"); do
        for a in vector narrow; do
            step "interference_${a}_$k" "${MPI[@]}" -x TIDE_ACCUM_KERNEL="$a" -n "$n" \
                python3 -m tidearray.bench interference --impls tide --out "$OUT/narrow/$a-$k"
        done
    done
    for a in vector narrow; do
        step "rs_$a" "${MPI[@]}" -x TIDE_ACCUM_KERNEL="$a" -n "$n" python3 -m tidearray.bench rs \
            --impls tide,stock --workloads units --out "$OUT/narrow/rs-$a"
    done
}
run_calls() {  # host time of repeated calls with and without a plan, and their cProfiles
    step call_profile "${MPI[@]}" -n 2 python3 tests/gpu/call_profile.py "${TIDE_PROFILE_UNIT:-qwen3-30b-a3b}"; }
run_footprints() {  # which CTAs can share an SM with the GEMMs' (one process, no timing)
    step footprints timeout "$T" python3 tests/gpu/footprints.py "$OUT/footprints.json"; }
run_bounds() { step hw_bounds "${MPI[@]}" -n "${TIDE_BOUNDS_RANKS:-2}" python3 tests/gpu/hw_bounds.py "$OUT/hw_bounds.json"; }
run_plans() {  # plan tests on cuda at 2 ranks, then host time per plan call
    step plans_np2 "${MPI[@]}" -n 2 "${PYTEST[@]}" tests/mpi/test_plans.py tests/gpu/test_adamw_gpu.py
    step bench_plans "${MPI[@]}" -n 2 python3 -m tidearray.bench plans --workloads units \
        --out "$OUT/b"
}
run_train() {  # the trainer on cuda: small model, tide vs stock vs the floor (correctness)
    step train_small "${MPI[@]}" -n 2 python3 examples/train.py --model small --steps 20 \
        --impl all
}
run_jax() {  # the JAX example on the cuda backend (XLA's stream joined on the host)
    step jax_np2 "${MPI[@]}" -n 2 python3 examples/jax_train.py
}
run_train8b() {  # the step-time comparison (TIDE_TRAIN_ARGS adds flags)
    step train8b "${MPI[@]}" -n 2 python3 examples/train.py --model llama3-8b-8l \
        --tokens 8192 --steps "${TIDE_TRAIN_STEPS:-50}" --impl all --profile \
        --out "$OUT/train" ${TIDE_TRAIN_ARGS:-}
}
run_fsdp2() {  # real FSDP2 against shard_module, one run (TIDE_FSDP2_ARGS adds flags)
    step fsdp2 "${MPI[@]}" -n 2 python3 examples/compare_fsdp2.py --model llama3-8b-8l \
        --tokens 8192 --steps "${TIDE_FSDP2_STEPS:-50}" --lr-warmup 10 --profile \
        --out "$OUT/fsdp2" ${TIDE_FSDP2_ARGS:-}
}

# The torch front end on real models: the Hugging Face tests at 1-4 ranks (ranks sharing the
# GPU: correctness), an 8B-shaped model trained for 20 steps at 2 ranks, a 70B-shaped model's
# deferred init measured at 4 ranks, and the one-rank step of this build against the tree
# in before/ (another commit's tidearray/ and kernels/, untracked), passes alternating.
HF_TESTS=(tests/mpi/test_hf.py tests/mpi/test_torch.py tests/mpi/test_torch_state.py)
run_hf() {
    local n
    for n in 1 2 3 4; do step "hf_np$n" "${MPI[@]}" -n "$n" "${PYTEST[@]}" "${HF_TESTS[@]}"; done
}
run_hf8b() { step hf8b "${MPI[@]}" -n 2 python3 tests/gpu/hf_models.py train8b "$OUT/hf8b.json"; }
run_meta70b() { step meta70b "${MPI[@]}" -n 4 python3 tests/gpu/hf_models.py meta70b \
    "$OUT/meta70b.json"; }
run_ab() {  # TIDE_AB_PASSES (2) of: this build, then before/ (reversed on odd passes)
    local n build dir
    [ -d before/tidearray ] || { echo "== ab: no before/ tree"; status=1; return; }
    for n in $(seq 0 $((${TIDE_AB_PASSES:-2} - 1))); do
        for build in $([ $((n % 2)) -eq 0 ] && echo "after before" || echo "before after"); do
            dir=$PWD; [ "$build" = before ] && dir=$PWD/before
            step "ab_${build}_$n" env TIDE_BACKEND=cuda PYTHONPATH="/tmp/site:$dir:$PWD" timeout "$T" python3 \
                examples/compare_fsdp2.py --model llama3-8b-8l --tokens 8192 --impls tide \
                --steps "${TIDE_AB_STEPS:-25}" --warmup 5 --out "$OUT/ab_${build}_$n"
        done
    done
}

run_pipelines() {  # TIDE_GPU_PIPELINES="np2 jax|np3 faults|...": side by side (correctness
    local p pipes  # only: they share the GPUs); a summary line per pipeline and step
    IFS='|' read -ra pipes <<< "$TIDE_GPU_PIPELINES"
    : > "$LOGS/pipelines.txt"
    for p in "${pipes[@]}"; do
        (TIDE_GPU_TAR="" TIDE_GPU_PIPELINES="" TIDE_GPU_STEPS="$p" bash "$0" > "$LOGS/pipeline_${p// /_}.txt" 2>&1
         echo "pipeline '$p': exit $?" >> "$LOGS/pipelines.txt") &
    done
    wait
    grep -ah "^== .*: exit" "$LOGS"/pipeline_*.txt
    cat "$LOGS/pipelines.txt"
    ! grep -q "exit [1-9]" "$LOGS/pipelines.txt"
}

bundle() {  # TIDE_GPU_TAR=NAME: everything under $OUT into $OUT/NAME.tgz (few files come back)
    [ -n "${TIDE_GPU_TAR:-}" ] || return 0
    local tmp; tmp=$(mktemp -d)
    tar czf "$tmp/$TIDE_GPU_TAR.tgz" -C "$OUT" --exclude=report . && rm -rf "${OUT:?}"/* &&
        mv "$tmp/$TIDE_GPU_TAR.tgz" "$OUT/" && echo "== bundled into $OUT/$TIDE_GPU_TAR.tgz"
}

if [ -n "${TIDE_GPU_PIPELINES:-}" ]; then
    run_pipelines
    rc=$?
    bundle
    exit $rc
fi
for s in ${TIDE_GPU_STEPS:-info np2 np1 nodes}; do
    if declare -F "run_$s" > /dev/null; then "run_$s"; else echo "== $s: no such step"; status=1; fi
done
bundle
exit $status
