# Shared by tests/gpu/run.sh (the GPU tests) and benchmarks/run.sh (the benchmarks):
# installs the carried wheels (.whl/: nccl4py, pytest-mpi) into /tmp/site once per
# machine, sets PYTHONPATH, TIDE_GIT_COMMIT and the mpirun command line, and
# defines step (a logged, timed command) and bundle ($OUT into $OUT/$TIDE_GPU_TAR.tgz).
# Sourced from the repo root.
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
[ -z "${XLA_FLAGS:-}" ] || MPIRUN+=(-x XLA_FLAGS)
MPI=(timeout "$T" "${MPIRUN[@]}")
PYTEST=(python3 -m pytest --with-mpi -q -p no:cacheprovider -o faulthandler_timeout=60 -rf
        --durations=8)  # the slowest tests in each log: where a step's time goes
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

no_signal() {  # no_signal NAME: fail if step NAME's log shows a rank killed by a signal (a
    # crash at exit too, after its tests passed); for steps whose tests kill no process
    if grep -aqE "exited on signal|Segmentation fault|core dumped" "$LOGS/$1.log"; then
        echo "== $1: a rank died of a signal: $(grep -aoE "exited on signal [0-9]+[^.]*" \
            "$LOGS/$1.log" | head -1)"; status=1
    fi
}

bundle() {  # TIDE_GPU_TAR=NAME: everything under $OUT into $OUT/NAME.tgz (few files come back)
    [ -n "${TIDE_GPU_TAR:-}" ] || return 0
    local tmp; tmp=$(mktemp -d)
    tar czf "$tmp/$TIDE_GPU_TAR.tgz" -C "$OUT" --exclude=report . && rm -rf "${OUT:?}"/* &&
        mv "$tmp/$TIDE_GPU_TAR.tgz" "$OUT/" && echo "== bundled into $OUT/$TIDE_GPU_TAR.tgz"
}

stacks_after() {  # stacks_after SECONDS NAME PATTERN: a watcher (its pid in $!): if processes
    # (Python) whose command line matches PATTERN still run after SECONDS and the step's log
    # ($LOGS/NAME.log) has no pytest summary yet, every thread's native stack of each (cuda-gdb
    # attaches; there is no gdb) goes to $LOGS/NAME.stacks. It never attaches to a process
    # that has finished its tests (a summary in the log: the ranks are tearing down) or is
    # exiting (not running or sleeping): cuda-gdb attached to a process that is tearing down
    # its CUDA context crashed it once (exit 139 after its tests had passed).
    (sleep "$1"
     if grep -aqE "[0-9]+ (passed|failed|errors?|skipped)(, .*)? in [0-9.]+s" "$LOGS/$2.log" \
         2>/dev/null; then exit 0; fi
     for pid in $(pgrep -f "^python3? .*$3"); do
        case $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) in R|S|D) ;; *) continue ;; esac
        echo "== pid $pid: $(tr '\0' ' ' < "/proc/$pid/cmdline")"
        timeout 90 cuda-gdb -p "$pid" -batch -ex "thread apply all bt 40" 2>&1 | grep -v '^\[New'
    done > "$LOGS/$2.stacks" 2>&1) &
}
