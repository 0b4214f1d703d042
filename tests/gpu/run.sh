#!/usr/bin/env bash
# The GPU test entry point: run on the GPU machine from the repo root. Tests only; the
# benchmarks have their own runner, benchmarks/run.sh (same conventions).
#
#   bash tests/gpu/run.sh                      # the default steps: info np2 np1 nodes
#   TIDE_GPU_STEPS="np2 faults" bash tests/gpu/run.sh  # some steps: info np2 np1 nodes
#                                              # np3 np4 (ranks sharing GPUs)
#                                              # jax (examples/jax_train.py on cuda)
#                                              # jaxjit (tidearray.jax's GPU tests, 1-4
#                                              # ranks sharing the GPU; the example in bf16;
#                                              # jaxjit1 ... jaxjit4, jaxjit_bf16: one part)
#                                              # plans (the plan and AdamW tests at 2 ranks)
#                                              # faults (tests/core/test_faults.py on host and
#                                              # cuda), soak (2,000 steps at 2 and 4 ranks),
#                                              # debug (np2 with TIDE_DEBUG=1: stamps)
#                                              # hf (the Hugging Face, lifecycle and torch
#                                              # tests, 1-4 ranks)
#                                              # graphs (the CUDA graph tests, 1-4 ranks)
#                                              # eagerplans (fsdp and torch multi-rank
#                                              # tests with TIDE_UNIT_GRAPHS=0, 2 and 4 ranks)
#                                              # hfpar (hf's tests, 1-4 ranks at once)
#                                              # stress (timing-sensitive tests in loops
#                                              # beside other GPU jobs), sanitize
#                                              # (compute-sanitizer over a subset)
#   TIDE_GPU_PIPELINES="info np2 jax|np3 faults|np4 debug|nodes np1 soak" bash tests/gpu/run.sh
#                                              # those step lists side by side (correctness only)
#   TIDE_GPU_TIMEOUT=120 bash tests/gpu/run.sh # seconds per multi-rank command (300)
#   TIDE_MPI_ARGS="--bind-to none" bash tests/gpu/run.sh  # extra mpirun options
#   TIDE_GPU_TAR=run bash tests/gpu/run.sh     # $OUT bundled into $OUT/run.tgz at the end
#   TIDE_JAX_CACHE_SAVE=1 bash tests/gpu/run.sh  # JAX's compile cache into $OUT/jaxcache.tgz;
#                                              # a .jaxcache.tgz in the root seeds the next run
#
# Installs the carried wheels (.whl/: nccl4py, pytest-mpi) into /tmp/site, then
# runs the generic suite (tests/, but for the harness's tests: benchmarks/run.sh's tests
# step) and the GPU tests (each area's gpu/: GPU_TESTS) on the cuda backend under
# mpirun -n 2 and -n 1, the GPU tests once more with TIDE_LOCAL_SIZE=1 (two emulated
# nodes: the NCCL path). Logs go to $OUT (or
# ./gpu-logs), step logs to $TIDE_GPU_LOGS if set. Every multi-rank command runs under
# timeout. The set-up is tests/gpu/_env.sh, shared with benchmarks/run.sh.
source "$(dirname "$0")/_env.sh"

# The tiers of the library's areas (tests/README.md): the multi-rank and the GPU tests.
MPI_TESTS=(tests/core/mpi tests/fsdp/mpi tests/torch/mpi tests/jax/mpi)
GPU_TESTS=(tests/core/gpu tests/fsdp/gpu tests/torch/gpu tests/jax/gpu)
# tidearray.jax's jitted GPU tests compile for minutes at XLA's default flags (autotuning):
# they run in the jaxjit step alone, at 1-4 ranks, not again inside every other step.
JAXJIT_TESTS=tests/jax/gpu/test_jax_jit_gpu.py
NOT_JAXJIT=(--ignore="$JAXJIT_TESTS")
run_info() { step info "${MPI[@]}" -n 2 python3 -m tidearray.info; }
run_np2() {
    step np2 "${MPI[@]}" -n "${TIDE_GPU_RANKS:-2}" "${PYTEST[@]}" tests --ignore=tests/benchmarks \
        "${NOT_JAXJIT[@]}"
}
run_np1() {
    step np1 "${MPI[@]}" -n 1 "${PYTEST[@]}" tests --ignore=tests/benchmarks "${NOT_JAXJIT[@]}"
}
# Ranks sharing GPUs (rank -> device is local rank % count): correctness runs, not timings.
run_np3() {
    step np3 "${MPI[@]}" -n 3 "${PYTEST[@]}" "${MPI_TESTS[@]}" "${GPU_TESTS[@]}" "${NOT_JAXJIT[@]}"
}
run_np4() {
    step np4 "${MPI[@]}" -n 4 "${PYTEST[@]}" "${MPI_TESTS[@]}" "${GPU_TESTS[@]}" "${NOT_JAXJIT[@]}"
}
run_nodes() {  # two emulated nodes: NCCL takes no two ranks of one communicator on one GPU
    local gpus; gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
    if [ "${gpus:-0}" -lt 2 ]; then
        echo "== np2_nodes: skipped ($gpus GPU(s): the inter-node NCCL path needs two)"; return 0
    fi
    step np2_nodes "${MPI[@]}" -x TIDE_LOCAL_SIZE=1 -n 2 "${PYTEST[@]}" "${GPU_TESTS[@]}" \
        "${NOT_JAXJIT[@]}"
}
run_debug() {
    step np2_debug "${MPI[@]}" -x TIDE_DEBUG=1 -n 2 "${PYTEST[@]}" "${MPI_TESTS[@]}" \
        "${GPU_TESTS[@]}" "${NOT_JAXJIT[@]}"
}
run_faults() {  # starts its own mpiexec per case: not under mpirun
    step faults timeout "$T" python3 -m pytest -q -p no:cacheprovider -rf \
        tests/core/test_faults.py; }
run_soak() {  # TIDE_SOAK_STEPS (2000); before/after figures in $OUT/soak.jsonl
    for n in 2 4; do
        step "soak_np$n" "${MPI[@]}" -x TIDE_SOAK_STEPS="${TIDE_SOAK_STEPS:-2000}" \
            -x TIDE_SOAK_REPORT="$OUT/soak.jsonl" -n "$n" "${PYTEST[@]}" tests/core/mpi/test_soak.py
    done
}
run_plans() {  # plan tests on cuda at 2 ranks (host time per plan call: benchmarks/run.sh plans)
    step plans_np2 "${MPI[@]}" -n 2 "${PYTEST[@]}" tests/core/mpi/test_plans.py \
        tests/fsdp/gpu/test_adamw_gpu.py
}
run_jax() {  # the JAX example on the cuda backend (one jitted step, collectives on XLA's stream)
    step jax_np2 "${MPI[@]}" "${JAX_ENV[@]}" -n 2 python3 examples/jax_train.py
}
run_jaxjit() {  # tidearray.jax on cuda: 1-4 ranks sharing the GPU, then the example in bf16.
    # Run it alone: on the H200 its first runs, beside other steps sharing the GPU, sat in
    # XLA's compile of the first step for over a minute (cause not found). If a step's tests
    # still run after TIDE_JAX_STACKS_S (120 s; 0: no watcher), its ranks' native stacks go
    # next to its log (stacks_after). A rank that dies of a signal fails the step (no_signal).
    # Steps jaxjit1 ... jaxjit4 and jaxjit_bf16 run one rank count or the example alone (to
    # spread the rank counts over pipelines).
    local n
    for n in ${TIDE_JAXJIT_RANKS:-1 2 3 4}; do jaxjit_ranks "$n"; done
    run_jaxjit_bf16
}
# JAX at XLA's default flags, as users run it (XLA_FLAGS, where set, reaches every rank as
# it is). JAX's persistent cache on the machine's disk keeps XLA's per-fusion autotuning
# results, so what one test process autotuned the next finds; the steps' executables are
# compiled each time (their callbacks are baked into them, so JAX does not reuse them).
# The cache can travel between machines (each new one starts cold, and the first compiles
# of the JAX tests are minutes of autotuning): with TIDE_JAX_CACHE_SAVE=1 the run leaves
# it in $OUT/jaxcache.tgz; a .jaxcache.tgz in the repo root (carried) is unpacked into an
# empty cache first.
JAX_CACHE=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
if [ -f .jaxcache.tgz ] && [ -z "$(ls -A "$JAX_CACHE" 2>/dev/null)" ]; then
    mkdir -p "$JAX_CACHE" && tar xzf .jaxcache.tgz -C "$JAX_CACHE" &&
        echo "== JAX cache: $(find "$JAX_CACHE" -type f | wc -l) files from .jaxcache.tgz"
fi
save_jax_cache() {
    [ "${TIDE_JAX_CACHE_SAVE:-0}" = 1 ] && [ -d "$JAX_CACHE" ] || return 0
    tar czf "$OUT/jaxcache.tgz" -C "$JAX_CACHE" . &&
        echo "== JAX cache: $(du -h "$OUT/jaxcache.tgz" | cut -f1) in $OUT/jaxcache.tgz"
}
JAX_ENV=(-x JAX_COMPILATION_CACHE_DIR="$JAX_CACHE")
jaxjit_ranks() {  # jaxjit_ranks N: tidearray.jax's GPU tests at N ranks
    local n=$1 w=""
    if [ "${TIDE_JAX_STACKS_S:-120}" != 0 ]; then
        stacks_after "${TIDE_JAX_STACKS_S:-120}" "jaxjit_np$n" "test_jax_jit_gpu"; w=$!
    fi
    step "jaxjit_np$n" "${MPI[@]}" "${JAX_ENV[@]}" -n "$n" "${PYTEST[@]}" "$JAXJIT_TESTS"
    [ -z "$w" ] || kill "$w" 2>/dev/null
    no_signal "jaxjit_np$n"
}
for n in 1 2 3 4; do eval "run_jaxjit$n() { jaxjit_ranks $n; }"; done
run_jaxjit_bf16() {
    step jaxjit_bf16_np2 "${MPI[@]}" "${JAX_ENV[@]}" -n 2 python3 examples/jax_train.py --dtype bfloat16
    no_signal jaxjit_bf16_np2
}

# The torch front end on real models: the Hugging Face tests at 1-4 ranks (ranks sharing the
# GPU: correctness). Measured runs of real models are benchmarks/run.sh's hf8b and meta70b.
HF_TESTS=(tests/torch/mpi/test_hf.py tests/torch/mpi/test_lifecycle.py
          tests/torch/mpi/test_torch.py tests/torch/mpi/test_torch_state.py)
run_hf() {
    local n
    for n in 1 2 3 4; do step "hf_np$n" "${MPI[@]}" -n "$n" "${PYTEST[@]}" "${HF_TESTS[@]}"; done
}

# The same front-end tests, 1-4 ranks side by side (ranks sharing the GPU: correctness).
run_hfpar() {
    local n
    for n in 1 2 3 4; do step "hfpar_np$n" "${MPI[@]}" -n "$n" "${PYTEST[@]}" "${HF_TESTS[@]}" \
        > "$LOGS/hfpar_np$n.out" 2>&1 & done
    wait  # the steps ran in subshells: their exit lines say how they ended
    grep -ahE "^== hfpar_np.: exit|[0-9]+ (passed|failed)" "$LOGS"/hfpar_np*.out | sort -u
    if grep -aqE "^== hfpar_np.: exit [1-9]" "$LOGS"/hfpar_np*.out; then status=1; fi
}

# Graph plans, collectives in a user's capture, the captured CuPy and torch steps, 1-4 ranks.
GRAPH_TESTS=(tests/core/gpu/test_cuda_graphs.py tests/fsdp/gpu/test_captured_step.py
             tests/torch/gpu/test_torch_graph.py tests/core/mpi/test_graphs.py)
run_graphs() {
    local n
    for n in ${TIDE_GRAPH_RANKS:-1 2 3 4}; do
        step "graphs_np$n" "${MPI[@]}" -n "$n" "${PYTEST[@]}" "${GRAPH_TESTS[@]}"
    done
}
# Config.unit_graphs off (TIDE_UNIT_GRAPHS=0; on by default): the runtime's and the torch
# front end's multi-rank tests and the graph tests with every unit's collectives as eager
# plan calls, at 2 and 4 ranks, a rank's signal failing the step
run_eagerplans() {
    local n
    for n in ${TIDE_EAGER_PLAN_RANKS:-2 4}; do
        step "eagerplans_np$n" "${MPI[@]}" -x TIDE_UNIT_GRAPHS=0 -n "$n" "${PYTEST[@]}" \
            tests/fsdp/mpi tests/torch/mpi "${GRAPH_TESTS[@]}"
        no_signal "eagerplans_np$n"
    done
}

# The stress step: the timing-sensitive tests in loops while other jobs share the GPU on
# purpose, as on a busy node. A result that changes under load is a race, not noise.
#   foreground "adamw" (1 rank): the fused AdamW on the device (captured steps, eager
#     grouped and absent rows, side streams, a first step on another stream) and graph
#     plans, TIDE_STRESS_LOOPS times (30; TIDE_STRESS_TESTS: other pytest arguments), by
#     TIDE_STRESS_WORKERS processes at once (4);
#   beside it, each looping until the foreground is done (TIDE_STRESS_JOBS: rs graphs gemm;
#   add jax where a loop of its compiles fits the step's timeout):
#     "rs" (3 ranks): the pipeline's documented summing order, reduce-scatter, Slot-Reuse;
#     "graphs" (2 ranks): graph plans, collectives in a user's capture, the captured CuPy
#       and torch steps;
#     "jax" (2 ranks): tidearray.jax's jitted step on XLA's stream;
#     "gemm": back-to-back fp16 matrix products (tests/gpu/_gemm_load.py).
# One line per loop goes to $LOGS/stress/loops.txt (a failing loop keeps its log beside it),
# then a line per job: loops run and failed. Any failed loop fails the step.
A=tests/fsdp/gpu/test_adamw_gpu.py
STRESS_ADAMW=("$A::test_captured_step_matches_numpy"
              "$A::test_a_first_step_on_another_stream_waits_for_the_constructor"
              "$A::test_grouped_odd_offsets_and_side_stream" "$A::test_absent_kernel_matches_numpy"
              tests/core/gpu/test_cuda_graphs.py)
# (read -a takes one line: a default spread over lines here once ran its first line only.)
[ -z "${TIDE_STRESS_TESTS:-}" ] || read -ra STRESS_ADAMW <<< "$TIDE_STRESS_TESTS"
STRESS_RS=(tests/core/mpi/test_pipeline.py tests/core/mpi/test_reduce_scatter.py)

stress_loop() {  # stress_loop NAME RANKS LOOPS [MPIRUN ARGS --] TESTS...: LOOPS times, or
    # (LOOPS 0) until $SDIR/stop exists; one line per loop in $SDIR/loops.txt
    local name=$1 n=$2 loops=$3 k=0 rc log extra=(); shift 3
    if [ "${1:-}" = "-x" ]; then while [ "$1" != "--" ]; do extra+=("$1"); shift; done; shift; fi
    while { [ "$loops" -eq 0 ] && [ ! -e "$SDIR/stop" ]; } || [ "$k" -lt "$loops" ]; do
        k=$((k + 1)); log="$SDIR/$name.$k.log"
        "${MPI[@]}" "${extra[@]}" -n "$n" "${PYTEST[@]}" "$@" > "$log" 2>&1; rc=$?
        echo "$name loop $k: exit $rc: $(grep -aoE '[0-9]+ (passed|failed|errors?)' "$log" |
            sort | uniq -c | awk '{printf "%s %s x%s; ", $2, $3, $1}')" >> "$SDIR/loops.txt"
        [ "$rc" -ne 0 ] || rm -f "$log"  # the failing loops' logs stay
    done
}

run_stress() {
    SDIR="$LOGS/stress"; rm -rf "$SDIR"; mkdir -p "$SDIR"; : > "$SDIR/loops.txt"
    local jobs=" ${TIDE_STRESS_JOBS:-rs graphs gemm} " pids=() t0=$SECONDS
    echo "== stress: ${TIDE_STRESS_LOOPS:-30} loops of adamw beside:$jobs"
    [[ $jobs != *" gemm "* ]] || { python3 tests/gpu/_gemm_load.py "$SDIR/stop" \
        > "$SDIR/gemm.log" 2>&1 & pids+=($!); }
    [[ $jobs != *" rs "* ]] || { stress_loop rs 3 0 "${STRESS_RS[@]}" & pids+=($!); }
    [[ $jobs != *" graphs "* ]] || { stress_loop graphs 2 0 "${GRAPH_TESTS[@]}" & pids+=($!); }
    [[ $jobs != *" jax "* ]] || {
        stress_loop jax 2 0 "${JAX_ENV[@]}" -- "$JAXJIT_TESTS" & pids+=($!); }
    sleep 5  # the loads start first
    local w workers=${TIDE_STRESS_WORKERS:-4} loops=${TIDE_STRESS_LOOPS:-30} fg=()
    for ((w = 0; w < workers; w++)); do  # the loops shared out, the first workers one more
        stress_loop "adamw$w" 1 $((loops / workers + (w < loops % workers))) \
            "${STRESS_ADAMW[@]}" & fg+=($!)
    done
    wait "${fg[@]}"
    touch "$SDIR/stop"  # each job ends the loop under way, or is stopped after a grace
    local p t=0 alive=1
    while [ "$alive" -eq 1 ] && [ "$t" -lt "${TIDE_STRESS_GRACE_S:-90}" ]; do
        alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
        sleep 1; t=$((t + 1))
    done
    for p in "${pids[@]}"; do pkill -TERM -P "$p" 2>/dev/null; kill "$p" 2>/dev/null; done
    wait "${pids[@]}" 2>/dev/null  # a stopped loop writes no line: only finished loops count
    cat "$SDIR/gemm.log" 2>/dev/null
    awk '{split($0, a, " loop "); n[a[1]]++; if ($0 !~ /: exit 0:/) f[a[1]]++}
         END {for (j in n) printf "== stress %s: %d loops, %d failed\n", j, n[j], f[j]}' \
        "$SDIR/loops.txt" | sort
    grep -v ": exit 0:" "$SDIR/loops.txt" | sed 's/^/== stress FAILED /'
    if grep -qv ": exit 0:" "$SDIR/loops.txt"; then status=1; fi
    echo "== stress: exit $status after $((SECONDS - t0)) s"
}

# compute-sanitizer over a subset: memcheck and synccheck at 1 rank (the AdamW kernels, the
# accumulate, the copier, captured steps) and 2 ranks (the reduce-scatter pipeline: IPC
# memory, copy engines, stream memory operations), racecheck (shared memory) on the AdamW
# and accumulate kernels. Each log ends with the tool's ERROR SUMMARY; any error fails.
SAN_NP1=(tests/fsdp/gpu/test_adamw_gpu.py tests/core/gpu/test_cuda_engine.py -k
         "captured or another_stream or grouped_kernel or accumulate or copier")
SAN_NP2=(tests/core/mpi/test_pipeline.py tests/core/mpi/test_reduce_scatter.py
         tests/core/mpi/test_all_gather.py)
SAN_RACE=(tests/fsdp/gpu/test_adamw_gpu.py tests/core/gpu/test_cuda_engine.py -k
          "kernel_matches_numpy or accumulate_bitwise")
run_sanitize() {
    # API errors are not reported: cuda-bindings looks optional driver entry points up with
    # cuGetProcAddress, which answers CUDA_ERROR_INVALID_VALUE for those this driver lacks
    # (34 such "errors" per process, nothing else, when they were reported).
    local tool sanitizer=(compute-sanitizer --print-limit 20 --report-api-errors no)
    for tool in memcheck synccheck; do
        step "sanitize_${tool}_np1" "${MPI[@]}" -x TIDE_TEST_EXAMPLES=3 -x TIDE_TIMEOUT=600 -n 1 \
            "${sanitizer[@]}" --tool "$tool" "${PYTEST[@]}" "${SAN_NP1[@]}"
        step "sanitize_${tool}_np2" "${MPI[@]}" -x TIDE_TEST_EXAMPLES=3 -x TIDE_TIMEOUT=600 -n 2 \
            "${sanitizer[@]}" --tool "$tool" "${PYTEST[@]}" "${SAN_NP2[@]}"
    done
    step sanitize_racecheck_np1 "${MPI[@]}" -n 1 "${sanitizer[@]}" --tool racecheck \
        "${PYTEST[@]}" "${SAN_RACE[@]}"
    grep -aHE "(ERROR|RACECHECK) SUMMARY" "$LOGS"/sanitize_*.log
    if grep -aE "ERROR SUMMARY: [1-9]|\([1-9][0-9]* errors" "$LOGS"/sanitize_*.log > /dev/null; then
        status=1
    fi
}

run_pipelines() {  # TIDE_GPU_PIPELINES="np2 jax|np3 faults|...": side by side (correctness
    local p pipes  # only: they share the GPUs); a summary line per pipeline and step
    IFS='|' read -ra pipes <<< "$TIDE_GPU_PIPELINES"
    : > "$LOGS/pipelines.txt"
    for p in "${pipes[@]}"; do
        (TIDE_GPU_TAR="" TIDE_GPU_PIPELINES="" TIDE_GPU_NESTED=1 TIDE_GPU_STEPS="$p" bash "$0" > "$LOGS/pipeline_${p// /_}.txt" 2>&1
         echo "pipeline '$p': exit $?" >> "$LOGS/pipelines.txt") &
    done
    wait
    grep -ahE "^== .*: (exit|skipped)" "$LOGS"/pipeline_*.txt
    cat "$LOGS/pipelines.txt"
    ! grep -q "exit [1-9]" "$LOGS/pipelines.txt"
}

if [ -n "${TIDE_GPU_PIPELINES:-}" ]; then
    run_pipelines
    rc=$?
    bundle
    save_jax_cache
    exit $rc
fi
for s in ${TIDE_GPU_STEPS:-info np2 np1 nodes}; do
    if declare -F "run_$s" > /dev/null; then "run_$s"; else echo "== $s: no such step"; status=1; fi
done
bundle
[ -n "${TIDE_GPU_NESTED:-}" ] || save_jax_cache
exit $status
