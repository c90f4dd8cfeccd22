#!/usr/bin/env bash
# One prepared GPU check for a machine with an NVIDIA GPU (written for the H200 image: torch
# 2.11+cu130, nvcc 13.0, pytest; no network; nothing of ours installed). Under 8 minutes:
#   1. build speedtronic._C in place for the visible GPU (no pip, no network)
#   2. GPU-marked tests: every kernel vs the fallback on fresh random data, NaN-poisoned outputs,
#      mma layout vs hardware and vs the CPU emulation, CUDA-graph capture
#   3. compute-sanitizer memcheck + racecheck on one small case of every kernel
#   4. benchmarks (Muon step GPT-2-small and 1B-class, symmetric kernel vs cuBLAS, bandwidth);
#      prints a short table last, JSON to benchmarks/results/ and $RESULTS_DIR
#   5. on an sm_90 GPU: the Hopper sym_gemm (TMA + wgmma) vs cuBLAS, m in {512 ... 8192}, k in
#      {m, 4m}, fp16/bf16, plus the full step with it off / opted in (benchmarks/bench_sym_gemm.py)
#   6. trainer vs a hand-written loop on a GPT-2-small-class model, eager and compiled
#      (benchmarks/bench_trainer.py --device cuda)
#   7. one `speedtronic train` run of configs/gpt2_small_gpu.yaml (Muon, bf16): tok/s and MFU
#   8. a 30-step run of it with ooo_backprop: true: the start-of-run trial's keep/off decision
# Run it with the device tool's full 600 s: steps 1-5 took ~3 min on 2026-11-30; 6-8 add ~5.
# Exit status: 0 all passed; 3 no GPU (after the build step); else the failing step's status.
#   benchmarks/gpu_check.sh            # everything
#   GPU_CHECK_QUICK=1 benchmarks/gpu_check.sh   # skip bench_kernels_gpu's torch.compile baselines
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
LOG_DIR="${RESULTS_DIR:-$ROOT/benchmarks/results}"
mkdir -p "$LOG_DIR" "$ROOT/benchmarks/results"
declare -a SUMMARY=()
t_start=$(date +%s)
note() { echo "== gpu_check [$(( $(date +%s) - t_start ))s]: $*"; }
record() { SUMMARY+=("$1: $2"); }
finish() {
    echo
    echo "== gpu_check summary"
    for line in "${SUMMARY[@]}"; do echo "   $line"; done
    exit "$1"
}

# ---- 1. build ---------------------------------------------------------------------------------
note "building speedtronic._C in place"
if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]] && ! "$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    export TORCH_CUDA_ARCH_LIST="8.0;9.0+PTX"
fi
NVIDIA_INC="$("$PY" -c 'import nvidia, os; print(":".join(os.path.join(p, s, "include") for p in nvidia.__path__ for s in ("cu13", "cu12") if os.path.isdir(os.path.join(p, s, "include"))))' 2>/dev/null || true)"
export CPATH="${NVIDIA_INC}${CPATH:+:$CPATH}"
if ! SPEEDTRONIC_CUDA=1 "$PY" setup.py -q build_ext --inplace > "$LOG_DIR/gpu_check_build.log" 2>&1; then
    tail -40 "$LOG_DIR/gpu_check_build.log"
    record build "FAILED (log: $LOG_DIR/gpu_check_build.log)"
    finish 1
fi
record build "ok ($(( $(date +%s) - t_start ))s)"

# ---- the first step that needs a GPU -----------------------------------------------------------
if ! "$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    note "no CUDA device visible: stopping before the GPU steps"
    record gpu "none visible: tests, sanitizer and benchmarks not run"
    finish 3
fi
"$PY" -c "import logging; logging.basicConfig(level=logging.INFO); import speedtronic.kernels.ops, speedtronic.kernels.extension as k; st = k.status(); print(k.env_info()); raise SystemExit(0 if st.active else 1)" \
    || { record load "FAILED: kernels not active"; finish 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>/dev/null || true

# ---- 2. GPU tests ------------------------------------------------------------------------------
note "GPU tests"
"$PY" -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_kernels_gpu.py tests/ooo/test_scheduler.py 2>&1 | tee "$LOG_DIR/gpu_check_tests.log"
rc=${PIPESTATUS[0]}
record tests "$([[ $rc -eq 0 ]] && echo ok || echo "FAILED (exit $rc)") $(tail -1 "$LOG_DIR/gpu_check_tests.log")"
overall=$rc

# ---- 3. compute-sanitizer ----------------------------------------------------------------------
SAN="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
for tool in memcheck racecheck; do
    note "compute-sanitizer $tool"
    if [[ ! -x "$SAN" ]]; then record "sanitizer $tool" "unavailable (no compute-sanitizer)"; continue; fi
    timeout 240 "$SAN" --tool "$tool" --error-exitcode 9 "$PY" benchmarks/gpu_sanitize_case.py > "$LOG_DIR/gpu_check_$tool.log" 2>&1
    src=$?
    tail -5 "$LOG_DIR/gpu_check_$tool.log"
    if [[ $src -eq 0 ]]; then record "sanitizer $tool" ok
    elif grep -q "Device not supported\|Unable to find injection\|error 999" "$LOG_DIR/gpu_check_$tool.log"; then
        record "sanitizer $tool" "unavailable on this machine (see log)"
    else record "sanitizer $tool" "FAILED (exit $src)"; overall=1; fi
done

# ---- 4. benchmarks -----------------------------------------------------------------------------
note "out-of-order backprop benchmark"
"$PY" benchmarks/bench_ooo.py --device cuda --rounds 5 --steps 3 2>&1 | tee "$LOG_DIR/gpu_check_ooo.log"
oorc=${PIPESTATUS[0]}
record "bench ooo" "$([[ $oorc -eq 0 ]] && echo ok || echo "FAILED (exit $oorc)")"
[[ $oorc -ne 0 ]] && overall=1
[[ -n "${RESULTS_DIR:-}" ]] && cp -f "$ROOT"/benchmarks/results/ooo_cuda.* "$RESULTS_DIR"/ 2>/dev/null
note "benchmarks"
quick=()
[[ -n "${GPU_CHECK_QUICK:-}" ]] && quick=(--quick)
"$PY" benchmarks/bench_kernels_gpu.py --out-dir "$ROOT/benchmarks/results" "${quick[@]}" 2>&1 | tee "$LOG_DIR/gpu_check_bench.log"
brc=${PIPESTATUS[0]}
record bench "$([[ $brc -eq 0 ]] && echo ok || echo "FAILED (exit $brc)")"
[[ $brc -ne 0 ]] && overall=1

# ---- 5. Hopper symmetric GEMM ------------------------------------------------------------------
if "$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.get_device_capability() == (9, 0) else 1)"; then
    note "sym_gemm (sm_90a TMA + wgmma) vs cuBLAS"
    timeout 420 "$PY" benchmarks/bench_sym_gemm.py --out-dir "$ROOT/benchmarks/results" 2>&1 | tee "$LOG_DIR/gpu_check_sym_gemm.log"
    src=${PIPESTATUS[0]}
    record "bench sym_gemm" "$([[ $src -eq 0 ]] && echo ok || echo "FAILED (exit $src)")"
    [[ $src -ne 0 ]] && overall=1
else
    record "bench sym_gemm" "skipped (not an sm_90 GPU)"
fi

# ---- 6. trainer vs a hand-written loop, eager and compiled ------------------------------------
note "trainer vs hand loop (GPT-2-small class, bf16, hybrid Muon; eager and compiled)"
timeout 240 "$PY" benchmarks/bench_trainer.py --device cuda --steps 30 --repeats 2 2>&1 | tail -8 | tee "$LOG_DIR/gpu_check_trainer.log"
trc=${PIPESTATUS[0]}
record "bench trainer" "$([[ $trc -eq 0 ]] && echo ok || echo "FAILED (exit $trc)")"
[[ $trc -ne 0 ]] && overall=1
[[ -n "${RESULTS_DIR:-}" ]] && cp -f "$ROOT"/benchmarks/results/bench_trainer_cuda.* "$RESULTS_DIR"/ 2>/dev/null

# ---- 7. one `speedtronic train` run: tokens/s and MFU ------------------------------------------
note "speedtronic train configs/gpt2_small_gpu.yaml"
timeout 150 "$PY" -m speedtronic train --config configs/gpt2_small_gpu.yaml \
    --set run.output_dir="$LOG_DIR/gpu_check_runs" > "$LOG_DIR/gpu_check_train.log" 2>&1
xrc=$?
grep -E "step (25|300)/|eval step 300|summary|ooo|compile|cuda kernels" "$LOG_DIR/gpu_check_train.log" | tail -8
record "train gpt2-small" "$([[ $xrc -eq 0 ]] && echo "ok: $(grep -o 'median [0-9.]* model TFLOP/s[^|]*' "$LOG_DIR/gpu_check_train.log" | tail -1)" || echo "FAILED (exit $xrc)")"
[[ $xrc -ne 0 ]] && overall=1

# ---- 8. ooo_backprop: true in a real run: the start-of-run trial's decision ---------------------
note "speedtronic train with ooo_backprop: true (30 steps, eager): the trial's decision"
timeout 120 "$PY" -m speedtronic train --config configs/gpt2_small_gpu.yaml \
    --set run.output_dir="$LOG_DIR/gpu_check_runs_ooo" --set run.max_steps=30 \
    --set compile=false --set ooo_backprop=true > "$LOG_DIR/gpu_check_ooo_trial.log" 2>&1
orc=$?
grep -E "ooo backprop" "$LOG_DIR/gpu_check_ooo_trial.log" | tail -3
record "ooo trial" "$([[ $orc -eq 0 ]] && echo "ok: $(grep -o 'ooo backprop: [a-z]* after measuring[^(]*([^,]*' "$LOG_DIR/gpu_check_ooo_trial.log" | tail -1)" || echo "FAILED (exit $orc)")"
[[ $orc -ne 0 ]] && overall=1
finish "$overall"
