#!/usr/bin/env bash
# Every figure of issue 15 ("speed on real model shapes") on the real default model, one bench
# after another so no two share the cores; each bench prints its table, writes its JSON under
# bench/results/ and keeps its own in-run baseline. Run on a quiet machine:
#
#     bash bench/real_model_sweep.sh [--quick]     # ~12 min quiet; --quick: 1 repeat each
#
# The CPU anchor needs llama-cpp-python built into .venv (see bench/cpu_anchor.py); without
# it that row compares W4A16 with pdserve's dense fp32 instead. Logs: bench/results/sweep/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
R=3
if [[ "${1:-}" == "--quick" ]]; then R=1; fi
LOGS=bench/results/sweep
mkdir -p "$LOGS"

FAILED=()
run() {  # run NAME CMD...: one bench, its output teed to its log, its wall time noted; a bench
    # that fails (a llama.cpp built for another CPU dies with SIGILL) is reported at the end
    # and the others still run
    local name=$1; shift
    echo "== $name ($(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1 /proc/loadavg)): $*"
    local t0=$SECONDS rc=0
    "$@" 2>&1 | tee "$LOGS/$name.log" || rc=$?
    if ((rc)); then
        echo "== $name FAILED (exit $rc) after $((SECONDS - t0)) s"
        FAILED+=("$name")
    else
        echo "== $name took $((SECONDS - t0)) s"
    fi
}

run decode_b1 $PY bench/decode_bench.py --repeats $((R + 2)) --threads 2 --batches 1 \
    --configs default python-layers mkl --output bench/results/decode_b1.json
# what bounds batch 1's weight GEMVs here: the kernels against a plain read, 1 and 2 threads
run gemv_bound $PY bench/gemv_bound.py --repeats $((R * 5))
run decode_b32 $PY bench/decode_bench.py --repeats $R --threads 2 --batches 32 \
    --configs default python-layers mkl --output bench/results/decode_b32.json
if $PY -c "import llama_cpp" 2>/dev/null; then
    run cpu_anchor $PY bench/cpu_anchor.py --repeats $R --threads 2 --batches 1 8
else
    run cpu_anchor $PY bench/cpu_anchor.py --repeats $R --threads 2 --batches 1 8 \
        --without-llama-cpp
fi
run transfer $PY bench/transfer_bench.py --prompts 8 --output bench/results/transfer.json
run exposed_ttft $PY bench/cluster_bench.py --model default --prompt-tokens 2048 --requests 2 \
    --max-tokens 8 --kv-transports nixl gloo --skip-engine --output bench/results/cluster_2k.json
run ssd_read $PY bench/tier_bench.py --read-only 256 --repeats $((R * 3)) \
    --out bench/results/tiers_read.json
run disagg $PY bench/disagg_vs_colocated.py --model default --rates 0.03,0.1 --duration 60 \
    --long-len 1024 --slo-ttft-ms 60000 --slo-tpot-ms 1000 \
    --worker-arg=--kv-cache-memory-gb=0.75 --output bench/results/disagg_real.json \
    --plot bench/results/disagg_real.png
echo "== sweep done $(date -u +%H:%M:%S) UTC${FAILED[*]:+; failed: ${FAILED[*]}}"
((${#FAILED[@]} == 0))
