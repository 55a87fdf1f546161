#!/usr/bin/env bash
# One GPU check for an H200 (or any CUDA machine), from a bare checkout, in under 6 minutes:
#   (a) Triton kernels vs the torch reference at realistic shapes
#   (b) paged decode attention: KV bytes read / time vs HBM peak
#   (c) FP8 vs BF16 GEMM (torch._scaled_mm)
#   (d) end-to-end decode tokens/s of a ~1B random Llama, fp8 and n-gram speculation on/off
# Prints a table; writes gpu.json (and the log) into $OUT if set, else bench/results/.
#
#   bash bench/gpu/run.sh            # everything
#   SECTIONS="check decode" bash bench/gpu/run.sh
#   GPU_PYTEST=1 bash bench/gpu/run.sh   # also run tests/kernels on the GPU
#   PDSERVE_GPU_PYTHON=/path/to/python bash bench/gpu/run.sh   # skip the interpreter search
#
# Python: the machine's own python3 when its torch sees CUDA (GPU images ship torch + triton;
# the project's torch pin is for CPU machines and is never installed here), else a venv that
# pip fills from whatever index or wheel cache the machine can reach. The project itself is
# used from the checkout (PYTHONPATH), so nothing of it needs installing. Every section runs
# in its own process under its own time limit: one failure or hang does not stop the others.

set -u -o pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
OUT_DIR=${OUT:-$ROOT/bench/results}
mkdir -p "$OUT_DIR"
PARTS=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-gpu.XXXXXX")
MODEL_DIR=${PDSERVE_BENCH_MODEL:-${TMPDIR:-/tmp}/pdserve-bench-llama-1b}
LOG=$OUT_DIR/gpu_log.txt
SECTIONS=${SECTIONS:-"check decode gemm e2e"}
START=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

exec > >(tee "$LOG") 2>&1

log() { echo "[gpu-bench +$(( $(date +%s) - START ))s] $*"; }

has_cuda_torch() {
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}

pick_python() {
    for cand in python3 /opt/torch/.venv/bin/python3 python; do
        if command -v "$cand" >/dev/null 2>&1 && has_cuda_torch "$cand"; then
            echo "$cand"
            return 0
        fi
    done
    # No CUDA torch: on a machine with a GPU, try a venv (offline machines fail here quickly,
    # and we say so); never on a machine without one (it would fetch a multi-GB CUDA torch).
    command -v nvidia-smi >/dev/null 2>&1 || return 1
    local venv=$ROOT/.venv-gpu
    python3 -m venv --system-site-packages "$venv" >&2 &&
        timeout 240 "$venv/bin/pip" install -q torch triton numpy safetensors tokenizers \
            jinja2 msgpack >&2 &&
        has_cuda_torch "$venv/bin/python" && { echo "$venv/bin/python"; return 0; }
    return 1
}

# Run one step under a time limit; report, never abort the script.
step() {
    local limit=$1 name=$2
    shift 2
    log "$name: start (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then log "$name: TIMED OUT"; else log "$name: rc=$rc"; fi
    return 0
}

if [ -n "${PDSERVE_GPU_PYTHON:-}" ]; then
    PY=$PDSERVE_GPU_PYTHON
elif ! PY=$(pick_python); then
    log "no Python with a CUDA torch could be found or installed; nothing to run"
    exit 1
fi
log "python: $PY"
"$PY" - <<'EOF'
import importlib
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
for mod in ("triton", "numpy", "safetensors", "tokenizers", "jinja2", "msgpack", "grpc"):
    try:
        m = importlib.import_module(mod)
        print(f"  {mod} {getattr(m, '__version__', '?')}")
    except Exception as e:  # reported; the sections that need it fail soft
        print(f"  {mod} MISSING ({type(e).__name__}: {e})")
EOF
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true

for section in $SECTIONS; do
    case $section in
        check)  step 100 check  "$PY" bench/gpu/kernels_bench.py check --out "$PARTS" ;;
        decode) step 60  decode "$PY" bench/gpu/kernels_bench.py decode --out "$PARTS" ;;
        gemm)   step 45  gemm   "$PY" bench/gpu/kernels_bench.py gemm --out "$PARTS" ;;
        e2e)
            step 70 e2e-prepare "$PY" bench/gpu/e2e_bench.py prepare --model "$MODEL_DIR"
            for cfg in bf16 fp8 bf16+ngram fp8+ngram; do
                if [ $(( $(date +%s) - START )) -gt 300 ]; then
                    log "e2e $cfg: skipped (time budget)"
                    continue
                fi
                step 50 "e2e $cfg" "$PY" bench/gpu/e2e_bench.py run "$cfg" \
                    --model "$MODEL_DIR" --out "$PARTS"
            done ;;
        *) log "unknown section $section" ;;
    esac
done

if [ "${GPU_PYTEST:-0}" = 1 ]; then
    step 120 pytest "$PY" -m pytest -q -p no:cacheprovider tests/kernels
fi

"$PY" bench/gpu/report.py --parts "$PARTS" --out "$OUT_DIR/gpu.json"
log "finished"
