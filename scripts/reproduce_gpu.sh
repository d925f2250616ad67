#!/usr/bin/env bash
# Reproduce the GPU figures of docs/PERFORMANCE.md (and the README's speed table) on a CUDA machine.
# Run from the root of a clone with ddtree installed (pip install -e ".[test]"); each group runs
# the commands of its docs table and writes their outputs under $OUT, named as in results/ with
# this GPU's name (e.g. engine-long-h100.json). The codepair groups need the fixture: --fixture DIR
# or FIXTURE=DIR (default ../shared/fixtures/codepair).
#
#   bash scripts/reproduce_gpu.sh engine            # 27B shapes, 1K to 128K: the engine tables (one GPU)
#   bash scripts/reproduce_gpu.sh codepair          # codepair: every method and --budget auto, 3 drafters x 2 dtypes
#   bash scripts/reproduce_gpu.sh chat memory       # chat's time to first token per turn; the memory plan at 32K / 128K
#   bash scripts/reproduce_gpu.sh startup           # codepair: generate and selftest in fresh processes, cold and warm
#   bash scripts/reproduce_gpu.sh serve             # codepair: a one-off generate --server; 27B shapes: decode through the server
#   bash scripts/reproduce_gpu.sh split             # 27B shapes: the layer split with both stages on one GPU
#   bash scripts/reproduce_gpu.sh profile verify    # where a round's time goes; the verify's GEMMs and GDN recurrence
#   bash scripts/reproduce_gpu.sh suite             # the GPU tests
#   bash scripts/reproduce_gpu.sh blas              # 27B shapes: the engine at 1K / 32K and the layer split, cuBLAS against cuBLASLt
#   bash scripts/reproduce_gpu.sh twogpu            # two GPUs: layer split and TP=2 against one GPU, one TP rank
#   bash scripts/reproduce_gpu.sh all               # every group but twogpu
set -u -o pipefail
GROUPS_KNOWN="engine codepair chat memory startup serve split profile verify suite blas twogpu"
FIXTURE=${FIXTURE:-../shared/fixtures/codepair}
OUT=${OUT:-gpu-results}
PY=${PYTHON:-python3}
args=()
while [ $# -gt 0 ]; do
    case "$1" in
    --fixture) FIXTURE=$2; shift 2 ;;
    --fixture=*) FIXTURE=${1#--fixture=}; shift ;;
    --out) OUT=$2; shift 2 ;;
    all) args+=(engine codepair chat memory startup serve split profile verify suite blas); shift ;;
    *) args+=("$1"); shift ;;
    esac
done
[ ${#args[@]} -gt 0 ] || { echo "error: name groups among: $GROUPS_KNOWN, or all" >&2; exit 2; }
for group in "${args[@]}"; do  # every name checked before anything runs
    case " $GROUPS_KNOWN " in *" $group "*) ;; *) echo "error: unknown group '$group': name groups among: $GROUPS_KNOWN, or all" >&2; exit 2 ;; esac
    case "$group" in codepair|startup|serve|profile|suite)
        [ -f "$FIXTURE/target/config.json" ] || { echo "error: group $group needs the codepair fixture: pass --fixture DIR (no target/config.json under $FIXTURE)" >&2; exit 2; } ;;
    esac
done
command -v nvidia-smi >/dev/null && "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' \
    || { echo "error: no CUDA GPU visible: run this on a machine with one (and torch built for CUDA)" >&2; exit 2; }
GPU=${GPU:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oE '[A-Z]+[0-9]+' | head -1 | tr 'A-Z' 'a-z')}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

step() {  # step LOG COMMAND...: one run, its output teed into $OUT/LOG
    local log=$1; shift
    echo "== $*" | tee -a "$OUT/$log"
    "$@" 2>&1 | tee -a "$OUT/$log"
    echo "== exit ${PIPESTATUS[0]}" | tee -a "$OUT/$log"
}

for group in "${args[@]}"; do
case "$group" in
engine)  # "Qwen3.6-27B shapes, one GPU", "Qwen3-8B shapes", the transformers row of "Targets", the projection's split
    step engine.log "$PY" scripts/bench_engine.py --sizes 1,16,17,32,33,64,65 --out "$OUT/engine-long-$GPU.json"
    step engine-dense.log "$PY" scripts/bench_engine.py --parts dense --out "$OUT/engine-dense-$GPU.json"
    step engine.log "$PY" scripts/bench_engine.py --contexts 1024 --hf --out "$OUT/engine-$GPU.json"
    # the H100 table, the kernels' profile and the projection's split: 1K and 32K profiled, then 128K
    step engine.log "$PY" scripts/bench_engine.py --contexts 1024,32768 --sizes 1,16,17,32,33,64,65 --budgets 15,16,31,32,63,64 \
        --profile --out "$OUT/engine-1k-32k-$GPU.json"
    step engine.log "$PY" scripts/bench_engine.py --contexts 131072 --sizes 1,16,17,32,33,64,65 --budgets 15,16,31,32,63,64 \
        --out "$OUT/engine-128k-$GPU.json"
    ;;
codepair)  # "codepair on one GPU"
    step codepair.log "$PY" scripts/bench_auto.py --fixture "$FIXTURE" --out-dir "$OUT/auto-$GPU"
    ;;
chat)  # USAGE.md's chat figures and the chat rows of "Targets"
    step chat.log "$PY" scripts/bench_serve.py chat --out "$OUT/chat-$GPU.json"
    ;;
memory)  # the memory-plan row of "Targets"
    step memory.log "$PY" scripts/check_memory_plan.py --prompt-tokens 32768 --out "$OUT/memory-plan-32k-$GPU.json"
    step memory.log "$PY" scripts/check_memory_plan.py --prompt-tokens 131072 --out "$OUT/memory-plan-128k-$GPU.json"
    ;;
startup)  # USAGE.md's start-up table; Python keeps the bytecode it compiles, as after a pip install
    step startup.log env -u PYTHONDONTWRITEBYTECODE "$PY" scripts/bench_startup.py --codepair "$FIXTURE" \
        --cases generate,selftest,profile --logs "$OUT/startup-logs" --out "$OUT/startup-$GPU.json"
    ;;
serve)  # SERVE.md's one-off and server-against-bench tables
    step serve.log "$PY" scripts/bench_serve.py oneoff --fixture "$FIXTURE" --baseline --out "$OUT/serve-oneoff-$GPU.json"
    step serve.log "$PY" scripts/bench_serve.py random --chat --out "$OUT/serve-27b-$GPU.json"
    ;;
split)  # "The layer split on one GPU"
    step split.log "$PY" scripts/bench_multigpu.py --split-devices cuda:0,cuda:0 --no-eager --out "$OUT/split-$GPU.json"
    ;;
profile)  # "Where the time goes"
    step profile.log "$PY" scripts/profile_round.py --preset qwen3.6-27b --prefill 8192 --out "$OUT/profile-prefill-$GPU.json"
    step profile.log "$PY" scripts/profile_round.py --target "$FIXTURE/target" --drafter "$FIXTURE/drafter-large" \
        --methods ar,dflash,ddtree:8,ddtree:auto --graphs --out "$OUT/profile-auto-$GPU.json"
    ;;
verify)  # "What misses its target, and why": the verify's weight GEMMs and its GDN tree recurrence
    step verify.log "$PY" scripts/bench_verify.py --out "$OUT/verify-parts-$GPU.json"
    step verify.log "$PY" scripts/bench_verify.py --parts core --nodes 17,33,64,65 --tiles 64,8 \
        --out "$OUT/verify-core-2pass-$GPU.json"
    step verify.log "$PY" scripts/bench_verify.py --parts core --nodes 17,33,65 --blocks --tiles \
        --out "$OUT/verify-fused-$GPU.json"
    # one GDN layer from the projection, as the engine runs it, and each kernel after the projection / back to back
    step verify.log "$PY" scripts/bench_verify.py --parts tile --tile-sweep --nodes 16,17,33 --out "$OUT/verify-cold-tile-$GPU.json"
    step verify.log "$PY" scripts/bench_verify.py --parts core --nodes 33,64,65 --kernels --blocks --mats-chunks \
        --out "$OUT/verify-cold-$GPU.json"
    ;;
suite)  # the GPU-suite row of "Targets"
    step suite.log env DDTREE_FIXTURE="$FIXTURE" "$PY" -m pytest -q -m gpu -n 6 -p no:cacheprovider --durations=20 tests
    step suite.log "$PY" scripts/check_logits_error.py --out "$OUT/logits-error-$GPU.json"  # the logits test's inputs and others
    ;;
blas)  # the weight GEMMs' library (DDTREE_BLAS): cuBLAS (torch's own default) against cuBLASLt, back to back
    for b in cublas cublaslt; do
        step blas.log env DDTREE_BLAS=$b "$PY" scripts/bench_engine.py --contexts 1024,32768 --sizes 1,16,17,32,33,64,65 \
            --budgets 15,31,32,64 --out "$OUT/blas-$b-$GPU.json"
        step blas.log env DDTREE_BLAS=$b "$PY" scripts/bench_multigpu.py --split-devices cuda:0,cuda:0 --no-eager \
            --out "$OUT/split-blas-$b-$GPU.json"
    done
    ;;
twogpu)  # "Two GPUs" (two GPUs), and one TP rank on the first
    step twogpu.log "$PY" scripts/bench_multigpu.py --tokens 32 --out "$OUT/multigpu-${GPU}x2.json"
    step twogpu.log "$PY" scripts/bench_tp_rank.py --full --out "$OUT/tp-rank-$GPU.json"
    ;;
esac
done
echo "outputs in $OUT"
