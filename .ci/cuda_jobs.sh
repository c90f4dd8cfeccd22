#!/usr/bin/env bash
# CUDA CI jobs; need nvcc (13.0 at /usr/local/cuda) and PyPI, but no GPU. Called by .ci/run.
#   (i)  compile-only: every launcher (.cu) for sm_80 and sm_90 with ptxas spill and local-memory
#        warnings as errors, then a SASS check (cuobjdump from the nvidia-cuda-cuobjdump wheel)
#        that the symmetric Newton-Schulz kernel really runs on tensor cores (HMMA.16816).
#        The Hopper symmetric GEMM (csrc/sym_gemm_sm90.cu) again for sm_90a, as setup.py builds it,
#        with the same resource gates, and a SASS check that every instantiation issues wgmma
#        (HGMMA) and bulk tensor copies (UTMALDG).
#   (ii) full build of speedtronic._C against torch==2.14.1 (cu130) in a venv made here,
#        `import speedtronic._C`, and a check that every op of speedtronic.kernels.ops has a CUDA kernel
#        registered with the dispatcher.
#   (iii) a failed in-place rebuild (an nvcc that fails every compile) deletes the previous _C.
# About 8 minutes on 2 cores (venv 2-3 min, compile-only 1-2 min, full build ~4 min).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
NVCC="$CUDA_HOME/bin/nvcc"
if [[ ! -x "$NVCC" ]]; then
    echo "ci: FAILED: nvcc not found at $NVCC (set CUDA_HOME)" >&2
    exit 1
fi
export CUDA_HOME
TORCH_CUDA_VERSION="${SPEEDTRONIC_CI_TORCH:-torch==2.14.1}"
VENV="${SPEEDTRONIC_CI_CUDA_VENV:-$ROOT/.speedtronic/ci-venv-cuda}"   # .speedtronic/ is git-ignored
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

echo "ci[cuda]: venv with $TORCH_CUDA_VERSION at $VENV"
if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --disable-pip-version-check "$TORCH_CUDA_VERSION" ninja setuptools wheel \
    pyyaml numpy nvidia-cuda-cuobjdump==13.2.86 nvidia-cuda-nvdisasm==13.2.86
NVBIN="$("$VENV/bin/python" -c 'import nvidia, os; print(next(os.path.join(p, "cu13", "bin") for p in nvidia.__path__ if os.path.isdir(os.path.join(p, "cu13", "bin"))))')"

# ---- (i) compile-only with resource gates, then SASS ---------------------------------------
for arch in 80 90; do
    for cu in csrc/*.cu; do
        obj="$WORK/$(basename "$cu" .cu)_sm$arch.o"
        echo "ci[cuda]: nvcc sm_$arch $cu"
        "$NVCC" -std=c++17 -O3 -c "$cu" -o "$obj" -Icsrc \
            -gencode "arch=compute_$arch,code=sm_$arch" \
            -Xptxas -warn-spills,-warn-lmem-usage --Werror all-warnings
    done
    sass="$("$NVBIN/cuobjdump" --dump-sass "$WORK/symmetric_gemm_sm$arch.o" \
        | awk '/Function :/ {on = ($0 ~ /syrk_mma_kernel/)} on')"
    hmma="$(grep -c 'HMMA\.16816\.F32' <<<"$sass" || true)"
    if [[ "$hmma" -lt 16 ]]; then
        echo "ci: FAILED: syrk_mma_kernel for sm_$arch has $hmma HMMA.16816 instructions (tensor cores not used)" >&2
        exit 1
    fi
    echo "ci[cuda]: sm_$arch syrk_mma_kernel: $hmma HMMA.16816 instructions, no spills"
done

echo "ci[cuda]: nvcc sm_90a csrc/sym_gemm_sm90.cu"
if ! "$NVCC" -std=c++17 -O3 -c csrc/sym_gemm_sm90.cu -o "$WORK/sym_gemm_sm90a.o" -Icsrc \
        -gencode "arch=compute_90a,code=sm_90a" \
        -Xptxas -v,-warn-spills,-warn-lmem-usage --Werror all-warnings 2>"$WORK/sym_gemm_sm90a.ptxas"; then
    cat "$WORK/sym_gemm_sm90a.ptxas" >&2
    echo "ci: FAILED: nvcc sm_90a csrc/sym_gemm_sm90.cu" >&2
    exit 1
fi
# ptxas reports wgmma it had to serialize (a large, silent slowdown) as info, not as a warning.
if grep -i "serializ" "$WORK/sym_gemm_sm90a.ptxas"; then
    echo "ci: FAILED: ptxas serialized wgmma in csrc/sym_gemm_sm90.cu (see above)" >&2
    exit 1
fi
"$NVBIN/cuobjdump" --dump-sass "$WORK/sym_gemm_sm90a.o" >"$WORK/sym_gemm_sm90a.sass"
kernels="$(grep -o 'Function : [^ ]*sym_gemm_sm90_kernel[^ ]*' "$WORK/sym_gemm_sm90a.sass" | awk '{print $3}' || true)"
count=0
for fn in $kernels; do
    body="$(awk -v f="$fn" '/Function :/ {on = ($3 == f)} on' "$WORK/sym_gemm_sm90a.sass")"
    hgmma="$(grep -c 'HGMMA\.64x' <<<"$body" || true)"
    utma="$(grep -c 'UTMALDG' <<<"$body" || true)"
    if [[ "$hgmma" -lt 4 || "$utma" -lt 2 ]]; then
        echo "ci: FAILED: $fn (sm_90a) has $hgmma HGMMA and $utma UTMALDG instructions (want >= 4 and >= 2)" >&2
        exit 1
    fi
    echo "ci[cuda]: sm_90a $fn: $hgmma HGMMA, $utma UTMALDG, no spills"
    count=$((count + 1))
done
if [[ "$count" -ne 4 ]]; then
    echo "ci: FAILED: expected 4 sym_gemm_sm90_kernel instantiations (fp16/bf16 x 128/256) in the sm_90a SASS, found $count" >&2
    exit 1
fi

# ---- (ii) full extension build, import, registrations --------------------------------------
echo "ci[cuda]: building speedtronic._C against $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
PATH="$VENV/bin:$NVBIN:$PATH" TORCH_CUDA_ARCH_LIST="8.0;9.0+PTX" SPEEDTRONIC_CUDA=1 \
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-build-isolation --no-deps "$ROOT"
(cd "$WORK" && "$VENV/bin/python" - <<'EOF'
import logging

import torch

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
import speedtronic._C  # noqa: F401  (imports without a GPU)
import speedtronic.kernels.extension as kernels
import speedtronic.kernels.ops as ops  # defines the schemas, then hands CUDA_KERNEL_OPS to the loader

st = kernels.status()
print("ci[cuda]:", st.line(), kernels.env_info())
missing = [n for n in ops.CUDA_KERNEL_OPS
           if not torch._C._dispatch_has_kernel_for_dispatch_key(f"speedtronic::{n}", "CUDA")]
assert not missing, f"ops without a CUDA kernel: {missing}"
assert torch._C._dispatch_has_kernel_for_dispatch_key("speedtronic_debug::sym_gemm", "CUDA"), \
    "the sm_90a sym_gemm object was not linked in"
assert st.imported and "sm_80" in st.so_arches and "sm_90" in st.so_arches, st
assert torch.ops.speedtronic_debug.arch_list() != ""
assert torch._C._dispatch_has_kernel_for_dispatch_key("speedtronic_debug::poly_lt", "CUDA")
lt = torch.ops.speedtronic_debug.cublaslt_status()
assert lt == "ok", f"poly_lt cannot bind torch's cuBLASLt: {lt}"
print("ci[cuda]: poly_lt binds torch's cuBLASLt")
print(f"ci[cuda]: all {len(ops.CUDA_KERNEL_OPS)} kernel ops are registered; arches {st.so_arches}")
# The same build (torch's BuildExtension) also compiles the torch-free CPU kernel library.
import speedtronic.kernels.cpu as cpu_kernels

assert cpu_kernels.status().loaded, cpu_kernels.status().line()
print("ci[cuda]:", cpu_kernels.status().line())
EOF
)

# ---- (iii) a failed in-place rebuild leaves no stale _C behind -----------------------------
# An nvcc that answers --version but fails every compile; the copy holds a previous build's
# _C and build info, which setup.py must delete (else the loader imports the old binary).
STALE="$WORK/stale-tree"
mkdir -p "$STALE" "$WORK/fake-cuda/bin"
git ls-files -z | xargs -0 cp --parents -t "$STALE"
printf '#!/bin/sh\n[ "$1" = --version ] && exec "%s" --version\necho "fake nvcc: fails on purpose" >&2\nexit 1\n' \
    "$NVCC" > "$WORK/fake-cuda/bin/nvcc"
chmod +x "$WORK/fake-cuda/bin/nvcc"
so_name="_C$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
echo "previous build" > "$STALE/speedtronic/$so_name"
echo "{}" > "$STALE/speedtronic/_C.build.json"
(cd "$STALE" && CUDA_HOME="$WORK/fake-cuda" TORCH_CUDA_ARCH_LIST="9.0" \
    "$VENV/bin/python" setup.py -q build_ext --inplace > "$WORK/stale.log" 2>&1) || {
    cat "$WORK/stale.log" >&2; echo "ci: FAILED: a failed CUDA build failed the install" >&2; exit 1; }
if [[ -e "$STALE/speedtronic/$so_name" || -e "$STALE/speedtronic/_C.build.json" ]]; then
    cat "$WORK/stale.log" >&2
    echo "ci: FAILED: a failed in-place rebuild left the previous speedtronic/$so_name" >&2
    exit 1
fi
echo "ci[cuda]: a failed in-place rebuild removes the previous _C"
echo "ci[cuda]: passed"
