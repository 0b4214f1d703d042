#!/usr/bin/env bash
# The GPU benchmark entry point: run on the GPU machine from the repo root. The same
# conventions as the test runner (tests/gpu/run.sh, whose set-up tests/gpu/_env.sh it
# shares): .whl/ installed into /tmp/site, TIDE_GIT_COMMIT in every record, every
# multi-rank command under timeout (TIDE_GPU_TIMEOUT, 300 s), logs and records in $OUT.
#
#   bash benchmarks/run.sh                       # the default step: benchall
#   TIDE_BENCH_STEPS="calls fsdp2" bash benchmarks/run.sh   # some steps:
#       benchall   (python -m benchmarks all; TIDE_BENCH_DOCS: report directory)
#       suites     (each suite alone; TIDE_BENCH_SUITES, TIDE_BENCH_ARGS)
#       plans      (python -m benchmarks plans: host time per plan call)
#       graphs     (plans, then the trainer at one rank, eager and with its whole step
#                  captured: llama3-8b-8l, host time, step time and peak memory)
#       calls      (the plans suite on one unit, TIDE_PROFILE_UNIT (qwen3-30b-a3b): host
#                  time per eager all_gather / reduce_scatter call and per plan call)
#       train      (the trainer, small model: tide vs stock vs the floor)
#       train8b    (the same at the Llama-8B shape, profiled: the step-time comparison)
#       fsdp2      (benchmarks/steps/compare_fsdp2.py, Llama-8B shape: FSDP2 vs
#                  shard_module vs the floor)
#       units      (compare_fsdp2.py on small-32l at one rank: plain torch, plain with no-op
#                  hooks, the floor, FSDP2, shard_module eager, kept and captured: per-unit
#                  overhead of a host-bound model)
#       units8b    (the same impls at the Llama-8B shape, 8 layers, 8K tokens, one rank)
#       jax        (benchmarks/steps/jax_step.py, one rank: a JAX transformer, 8 layers,
#                  hidden 2048, 4K tokens, unsharded jit vs tidearray.jax)
#       jaxcompile (jax_step.py per impl, one process each: where the first compile goes:
#                  lowering, XLA, XLA again with its caches warm, GEMMs, XLA's timers and
#                  autotuning log; TIDE_JAX_COMPILE_IMPLS; then the goals over them)
#       jaxscan    (jax_step.py, tidearray-scan and unsharded scanned, at 4, 8, 16 and 32
#                  layers: compile time against depth, and the host time per step in
#                  tidearray's callbacks against the rest; TIDE_JAX_LAYERS; the impls
#                  TIDE_JAX_SCAN_IMPLS: unsharded needs 78 GiB at 32 layers, an H200's,
#                  where 'tidearray-scan,unsharded-remat' fits an H100)
#       tests      (the harness's and the baselines' tests, tests/benchmarks,
#                  at 2 ranks)
#       ab         (this tree against the one in before/: see below)
#   TIDE_GPU_TAR=run bash benchmarks/run.sh      # $OUT bundled into $OUT/run.tgz at the end
#
# ab: TIDE_AB_PASSES (2) passes, each running the steps named in TIDE_AB_STEPS (fsdp2ab)
# once against this tree and once against before/ (another commit's tidearray/ and
# kernels/, untracked; reversed order on odd passes), with that tree first on
# PYTHONPATH; step logs and outputs get the suffix _<before|after>_<pass>. A/B steps:
#       fsdp2ab    (one rank: compare_fsdp2.py --impls tide, TIDE_AB_ITERS steps (25))
#       unitsab    (one rank: compare_fsdp2.py on small-32l, plain and tide)
#       calls      (host time per eager call, as above: TIDE_AB_STEPS=calls)
source "$(dirname "$0")/../tests/gpu/_env.sh"
AB=""  # the A/B suffix of step names and outputs (empty outside ab)

run_benchall() { step "benchall$AB" "${MPI[@]}" -n 2 python3 -m benchmarks all \
    --out "$OUT/b$AB" ${TIDE_BENCH_DOCS:+--docs "$TIDE_BENCH_DOCS"}; }
run_suites() {  # the same suites as benchall, each under its own timeout, one record file
    local suite
    for suite in ${TIDE_BENCH_SUITES:-interference memory ag rs}; do
        step "bench_$suite" timeout "${TIDE_BENCH_TIMEOUT:-150}" "${MPIRUN[@]}" -n 2 \
            python3 -m benchmarks "$suite" --out "$OUT/b" ${TIDE_BENCH_ARGS:-}
    done
}
run_plans() {  # host time per plan call
    step bench_plans "${MPI[@]}" -n 2 python3 -m benchmarks plans --workloads units \
        --out "$OUT/b"
}
run_graphs() {  # CUDA graphs: host time per graph plan call, and the captured trainer step
    run_plans
    step train_graph "${MPI[@]}" -n 1 python3 benchmarks/steps/compare_train.py --impl graph \
        --model llama3-8b-8l --tokens 8192 --steps 20 --out "$OUT/train_graph"
}
run_calls() {  # host time of eager calls and of plan calls on one unit; python3 -P puts
    # no working directory ahead of PYTHONPATH, so the tidearray first there is measured (ab)
    step "calls$AB" "${MPI[@]}" -n 2 python3 -P -m benchmarks plans --workloads units \
        --units "${TIDE_PROFILE_UNIT:-qwen3-30b-a3b}" --out "$OUT/calls$AB"
}
run_train() {  # the trainer on cuda: small model, tide vs stock vs the floor (correctness)
    step train_small "${MPI[@]}" -n 2 python3 benchmarks/steps/compare_train.py --model small \
        --steps 20 --impl all
}
run_train8b() {  # the step-time comparison (TIDE_TRAIN_ARGS adds flags)
    step train8b "${MPI[@]}" -n 2 python3 benchmarks/steps/compare_train.py --model llama3-8b-8l \
        --tokens 8192 --steps "${TIDE_TRAIN_STEPS:-50}" --impl all --profile \
        --out "$OUT/train" ${TIDE_TRAIN_ARGS:-}
}
run_fsdp2() {  # real FSDP2 against shard_module, one run (TIDE_FSDP2_ARGS adds flags)
    step fsdp2 "${MPI[@]}" -n 2 python3 benchmarks/steps/compare_fsdp2.py --model llama3-8b-8l \
        --tokens 8192 --steps "${TIDE_FSDP2_STEPS:-50}" --lr-warmup 10 --profile \
        --out "$OUT/fsdp2" ${TIDE_FSDP2_ARGS:-}
}
run_units() {  # per-unit overhead on a host-bound model at one rank: plain torch, the floor,
    # FSDP2 and shard_module eager and captured (compare_fsdp2.py, small-32l)
    step units env TIDE_BACKEND=cuda timeout "$T" python3 benchmarks/steps/compare_fsdp2.py \
        --model small-32l --impls plain,hooks,floor,fsdp2,tide,tide-kept,tide-graph --interleave \
        --steps "${TIDE_UNITS_STEPS:-30}" --host-profile 5 --out "$OUT/units"
}
run_units8b() {  # the same per-unit comparison at the Llama-8B shape (8 layers, 8K tokens),
    # one rank: host time matters less there; tide casts every parameter once more per
    # step than plain does, tide-kept (bf16 shards kept: at one rank, views) none
    step units8b env TIDE_BACKEND=cuda timeout "$T" python3 benchmarks/steps/compare_fsdp2.py \
        --model llama3-8b-8l --tokens 8192 --impls plain,floor,fsdp2,tide,tide-kept,tide-graph \
        --steps "${TIDE_UNITS_STEPS:-30}" --out "$OUT/units8b"
}
run_jax() {  # a JAX transformer's step at one rank: unsharded jit, tidearray.jax in one jit
    # (released/kept parameters, command buffers); TIDE_JAX_ARGS adds flags
    local w
    stacks_after "${TIDE_JAX_STACKS_S:-240}" jax_step "jax_step.py"; w=$!  # if it stalls
    step jax_step "${MPI[@]}" -n 1 python3 benchmarks/steps/jax_step.py --profile --out "$OUT/jax" \
        ${TIDE_JAX_ARGS:-}
    kill "$w" 2>/dev/null
}
run_jaxcompile() {  # where the JAX step's first compile goes, one process per impl: JAX's
    # lowering and XLA's compile, again with XLA's in-process caches warm (--recompile), XLA's
    # phase timers (logging only) and its autotuning log (which instructions it autotuned)
    local impl d
    for impl in ${TIDE_JAX_COMPILE_IMPLS:-tidearray tidearray-keep unsharded-remat unsharded}; do
        d="$OUT/jaxcompile/$impl"; mkdir -p "$d"
        step "jaxcompile_$impl" env TF_CPP_MIN_LOG_LEVEL=0 JAX_LOG_COMPILES=1 \
            TF_CPP_VMODULE=gpu_compiler=1,nvptx_compiler=1,hlo_pass_pipeline=1,autotuner_pass=1,gemm_fusion_autotuner=1 \
            XLA_FLAGS="--xla_gpu_dump_autotune_logs_to=$d/autotune_logs.txt" \
            "${MPI[@]}" -x TF_CPP_MIN_LOG_LEVEL -x TF_CPP_VMODULE -x XLA_FLAGS \
            -x JAX_LOG_COMPILES \
            -n 1 python3 benchmarks/steps/jax_step.py --impls "$impl" --recompile --steps 2 \
            --warmup 1 --out "$d"
    done  # the goals over those processes: each impl's compile paid its own autotuning
    step jaxcompile_report python3 benchmarks/steps/jax_step.py \
        --report "$OUT"/jaxcompile/*/jax_step.json
}
run_jaxscan() {  # the scanned step's compile time against depth (TIDE_JAX_LAYERS)
    local n
    for n in ${TIDE_JAX_LAYERS:-4 8 16 32}; do
        step "jaxscan_$n" "${MPI[@]}" -n 1 python3 benchmarks/steps/jax_step.py \
            --impls "${TIDE_JAX_SCAN_IMPLS:-tidearray-scan,unsharded}" --scan --layers "$n" \
            --steps 3 --warmup 2 --out "$OUT/jaxscan/l$n"
    done
}
run_fsdp2ab() {  # one rank, shard_module only: the step time an A/B compares
    step "ab$AB" env TIDE_BACKEND=cuda timeout "$T" python3 benchmarks/steps/compare_fsdp2.py \
        --model llama3-8b-8l --tokens 8192 --impls tide --steps "${TIDE_AB_ITERS:-25}" \
        --warmup 5 --out "$OUT/ab$AB"
}
run_unitsab() {  # one rank, the host-bound small-32l: plain (the pass's noise) and tide
    step "unitsab$AB" env TIDE_BACKEND=cuda timeout "$T" python3 benchmarks/steps/compare_fsdp2.py \
        --model small-32l --impls plain,tide --steps "${TIDE_AB_ITERS:-25}" --warmup 5 \
        --out "$OUT/unitsab$AB"
}
run_tests() { step bench_tests "${MPI[@]}" -n 2 "${PYTEST[@]}" tests/benchmarks; }
run_ab() {  # TIDE_AB_PASSES (2) of: this tree, then before/ (reversed on odd passes)
    local n build s path=$PYTHONPATH
    [ -d before/tidearray ] || { echo "== ab: no before/ tree"; status=1; return; }
    for n in $(seq 0 $((${TIDE_AB_PASSES:-2} - 1))); do
        for build in $([ $((n % 2)) -eq 0 ] && echo "after before" || echo "before after"); do
            AB="_${build}_$n"
            export PYTHONPATH=$path
            [ "$build" = before ] && export PYTHONPATH=/tmp/site:$PWD/before:$PWD
            for s in ${TIDE_AB_STEPS:-fsdp2ab}; do
                if declare -F "run_$s" > /dev/null; then "run_$s"
                else echo "== ab: no such step $s"; status=1; fi
            done
        done
    done
    export PYTHONPATH=$path
    AB=""
}

for s in ${TIDE_BENCH_STEPS:-benchall}; do
    if declare -F "run_$s" > /dev/null; then "run_$s"; else echo "== $s: no such step"; status=1; fi
done
bundle
exit $status
