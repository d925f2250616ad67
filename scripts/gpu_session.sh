#!/usr/bin/env bash
# The device runs that produce the GPU figures the docs quote, in groups that fit one call of the
# device machine (10 minutes). Run from the repository root with the wheels in .whl/ (loguru,
# flash-linear-attention, fla-core, prompt_toolkit, wcwidth) and, for the codepair groups, the
# fixture as .fixture/codepair.tar.xz; outputs go to $OUT (default /tmp/ddtree-out).
#   scripts/gpu_session.sh chat        # 27B shapes: chat TTFT table, memory plan at 32K and 128K
#   scripts/gpu_session.sh suite       # codepair: the GPU test suite
#   scripts/gpu_session.sh auto        # codepair: --budget auto against the fixed methods (AUTO_ARGS="--dtypes bfloat16": one dtype)
#   scripts/gpu_session.sh verify      # 27B shapes: the fused GDN tree kernel at 33 / 65 nodes, the 1K engine with it
#   scripts/gpu_session.sh startup     # codepair: start-up cold and warm (generate, selftest, generate under cProfile);
#                                      # 27B shapes: the memory plan at 32K
#   scripts/gpu_session.sh memory      # 27B shapes: the memory plan at 32K
#   scripts/gpu_session.sh gemms       # 27B shapes: the weight GEMMs at 1 to 65 rows through cuBLAS and cuBLASLt, the 1K engine
#                                      # with DDTREE_BLAS=cublaslt; the kernels of a 33-node verify by kind (profile_round)
#   scripts/gpu_session.sh autoprof    # codepair drafter-large, bf16: kernels and wall per round of ar, dflash, ddtree 8
#                                      # and --budget auto (its plain steps and tree rounds against ar's and ddtree 8's)
#   scripts/gpu_session.sh imports     # codepair: the setup phase step by step and python -X importtime, three fresh processes
#   scripts/gpu_session.sh split       # 27B shapes: two stages on one GPU (the graphed split, the default) against one
#                                      # (SPLIT_ARGS=--no-eager: without the eager twin's timing)
#   scripts/gpu_session.sh startup auto  # several groups, in order, in one call
set -u -o pipefail
GROUPS_KNOWN="chat suite auto startup memory gemms autoprof imports verify split"
[ $# -gt 0 ] || set -- ""
for group in "$@"; do  # every name checked before anything is installed or run
    known=no
    for g in $GROUPS_KNOWN; do [ "$group" = "$g" ] && known=yes; done
    [ $known = yes ] || { echo "error: name groups among: $GROUPS_KNOWN (got '$group')" >&2; exit 2; }
done
OUT=${OUT:-/tmp/ddtree-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# Bytecode as on a user's machine, where pip writes it at install and later processes read it: the
# image sets PYTHONDONTWRITEBYTECODE=1, so every process would compile the modules that have no
# .pyc (this repository, any package installed without one) from source again. Python may write it;
# where the installed packages' folders lack it and are read-only, it goes under a prefix folder.
unset PYTHONDONTWRITEBYTECODE
eval "$(python3 - 2>&1 <<'EOF' | tee -a "$OUT/bytecode.log"
import os, sys, transformers
root = os.path.dirname(transformers.__file__)
py = pyc = 0
for d, _, files in os.walk(root):
    py += sum(f.endswith(".py") for f in files)
    pyc += sum(f.endswith(".pyc") for f in files)
writable = os.access(root, os.W_OK)
print(f"# transformers: {py} .py, {pyc} .pyc, folder writable: {writable}")
if pyc < py // 2 and not writable:
    print("export PYTHONPYCACHEPREFIX=/tmp/ddtree-pycache")
EOF
)"
echo "# PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-}" | tee -a "$OUT/bytecode.log"
export DDTREE_COMMIT=${DDTREE_COMMIT:-$(git rev-parse --short HEAD)}  # the device copy's HEAD can lag: pass DDTREE_COMMIT=<hash> from here
fixture() {
    [ -d .fixture/codepair ] || python3 -c "import tarfile; tarfile.open('.fixture/codepair.tar.xz').extractall('.fixture')"
    export DDTREE_FIXTURE=$PWD/.fixture/codepair
}
step() {  # step SECONDS LOGNAME COMMAND...: one run, its output teed under $OUT
    local limit=$1 log=$2; shift 2
    echo "== $* (limit ${limit}s)" | tee -a "$OUT/$log"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$log"
    echo "== rc ${PIPESTATUS[0]} in $((SECONDS - t0))s" | tee -a "$OUT/$log"
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
for group in "$@"; do
case "$group" in
chat)
    step 360 chat.log python3 scripts/bench_chat.py --out "$OUT/chat-h200.json"
    step 150 memory.log python3 scripts/check_memory_plan.py --prompt-tokens 32768 --out "$OUT/memory-plan-32k-h200.json"
    step 200 memory.log python3 scripts/check_memory_plan.py --prompt-tokens 131072 --out "$OUT/memory-plan-128k-h200.json"
    ;;
suite)
    fixture
    step 560 suite.log python3 -m pytest -q -m gpu -n 4 -v -p no:cacheprovider --durations=20 tests
    ;;
auto)
    fixture
    step 380 auto.log python3 scripts/bench_auto.py --fixture .fixture/codepair ${AUTO_ARGS:-} --out-dir "$OUT/auto"
    tar -czf "$OUT/auto.tar.gz" -C "$OUT" auto && rm -rf "$OUT/auto"
    ;;
verify)
    step 240 verify.log python3 scripts/bench_verify.py --parts core --nodes 33,65 --blocks --tiles --out "$OUT/verify-fused-33-65-h200.json"
    step 150 engine.log env DDTREE_TREE_FUSED=0 python3 scripts/bench_engine.py --contexts 1024 --sizes 1,17,33,65 --out "$OUT/engine-1k-unfused-h200.json"
    step 150 engine.log env DDTREE_TREE_FUSED=65 python3 scripts/bench_engine.py --contexts 1024 --sizes 1,17,33,65 --out "$OUT/engine-1k-fused-h200.json"
    ;;
startup)
    fixture
    step 300 startup.log python3 scripts/bench_startup.py --codepair .fixture/codepair --cases generate,selftest,profile \
        --timeout 110 --logs "$OUT/startup-logs" --out "$OUT/startup-h200.json"
    tar -czf "$OUT/startup-logs.tar.gz" -C "$OUT" startup-logs && rm -rf "$OUT/startup-logs"
    step 150 memory.log python3 scripts/check_memory_plan.py --prompt-tokens 32768 --out "$OUT/memory-plan-32k-h200.json"
    ;;
memory)
    step 150 memory.log python3 scripts/check_memory_plan.py --prompt-tokens 32768 --out "$OUT/memory-plan-32k-h200.json"
    ;;
gemms)
    step 150 gemms.log python3 scripts/bench_verify.py --parts gemms --nodes 1,16,17,32,33,40,48,64,65 \
        --gemm-backends cublas,cublaslt --out "$OUT/verify-gemms-h200.json"
    step 150 engine.log env DDTREE_BLAS=cublaslt python3 scripts/bench_engine.py --contexts 1024 --sizes 1,17,33,65 \
        --out "$OUT/engine-1k-cublaslt-h200.json"
    step 250 profile.log python3 scripts/profile_round.py --preset qwen3.6-27b --methods ar,ddtree:32 --graphs --tokens 24 \
        --out "$OUT/profile-27b-round-h200.json"
    ;;
autoprof)
    fixture
    step 300 autoprof.log python3 scripts/profile_round.py --target .fixture/codepair/target --drafter .fixture/codepair/drafter-large \
        --methods ar,dflash,ddtree:8,ddtree:auto --graphs --out "$OUT/profile-auto-h200.json"
    ;;
imports)
    fixture
    step 120 imports.log python3 scripts/bench_startup.py --codepair .fixture/codepair --cases phases,importtime \
        --states first,second,third --logs "$OUT/imports-logs" --out "$OUT/startup-imports-h200.json"
    ;;
split)
    step 500 split.log python3 scripts/bench_split.py ${SPLIT_ARGS:-} --out "$OUT/split-h200.json"
    ;;
esac
done
