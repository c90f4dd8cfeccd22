"""One small, awkward call of every CUDA kernel, for compute-sanitizer (memcheck, racecheck).

Run by benchmarks/gpu_check.sh as `compute-sanitizer --tool memcheck python this_file.py`.
"""

from __future__ import annotations

import torch

import speedtronic.kernels.extension as kernels
import speedtronic.kernels.ops as ops


def main() -> int:
    st = kernels.status()  # importing speedtronic.kernels.ops loaded the kernels
    if not st.active:
        print(f"gpu_sanitize_case: kernels not active: {st.reason}")
        return 3
    sp, dbg = torch.ops.speedtronic, torch.ops.speedtronic_debug
    dev = "cuda"
    shapes = [(1, 67), (45, 1), (37, 45), (20001,)]
    u = [torch.randn(s, device=dev) for s in shapes]
    g = [torch.randn(s, device=dev).bfloat16() for s in shapes]
    sp.cautious_mask_(u, g, True)
    p = [torch.randn(s, device=dev) for s in shapes]
    m = [torch.zeros(s, device=dev) for s in shapes]
    v = [torch.zeros(s, device=dev) for s in shapes]
    gf = [x.float() for x in g]
    sp.cautious_adamw_step_(p, gf, m, v, 1e-3, 0.9, 0.99, 1e-8, 0.1, 1, True, True)
    bufs = [torch.zeros(37, 45, device=dev) for _ in range(3)]
    grads = [torch.randn(37, 45, device=dev) for _ in range(3)]
    x = sp.muon_pre_orthogonalize_(bufs, grads, 0.95, True, 1e-7, torch.float16)
    orth = sp.newton_schulz(x, 2, list(ops.QUINTIC), 1e-7, torch.float16, "auto", True)
    params = [torch.randn(37, 45, device=dev) for _ in range(3)]
    sp.muon_post_update_(params, orth, grads, 0.02, 0.1, 1.0, True, 1e-8, True, True)
    tall = torch.randn(45, 37, device=dev)  # a tall gradient read through the tile transpose
    lean_g = [grads[0], tall.mT]
    lean_m = [torch.zeros(37, 45, device=dev) for _ in lean_g]
    lean_o = [torch.empty(37, 45, device=dev).half() for _ in lean_g]
    mu = torch.tensor(0.95, device=dev)
    sp.muon_lean_pre_(lean_g, lean_m, lean_o, [], [mu], [0, 0], [1, 0], [1e-7, 1e-7])
    lr, wd = torch.tensor(0.02, device=dev), torch.tensor(0.1, device=dev)
    skip = torch.tensor([False, True], device=dev)
    rows = [torch.empty(37, device=dev), torch.empty(45, device=dev)]
    cols = [torch.empty(45, device=dev), torch.empty(37, device=dev)]
    sp.muon_lean_plus_stats_([lean_o[0], lean_o[1].mT], rows, cols, [1e-8, 1e-8])
    cgrads = [torch.randn(37, 45, device=dev), torch.randn(37, 45, device=dev).mT]
    kept = torch.empty(2, dtype=torch.int64, device=dev)
    sp.muon_lean_cautious_count_([lean_o[0], lean_o[1].mT], cgrads, kept)
    sp.muon_lean_update_([params[0], tall], [lean_o[0], lean_o[1].mT], [lr], [wd], [0, 0],
                         [1.0, 2.0], skip, [0, 1], rows, cols, cgrads, kept, [0, 1])
    sp.muon_plus_normalize(torch.randn(2, 130, 7, device=dev).bfloat16(), 1e-8)
    dbg.syrk(torch.randn(2, 130, 33, device=dev).half(), 1.0, 0.0, None)
    sym = torch.randn(3, 37, 37, device=dev).half()
    dbg.poly_lt(sym + sym.mT, -4.775, 2.0315)  # cuBLASLt, C != D
    xw = torch.randn(3, 37, 45, device=dev).half() / 40
    dbg.ns_step_lt(xw, torch.bmm(xw, xw.mT), 3.4445, -4.775, 2.0315)  # two such calls
    a, bt = torch.randn(16, 16, device=dev), torch.randn(8, 16, device=dev)
    dbg.mma_probe(a.bfloat16(), bt.bfloat16())
    if torch.cuda.get_device_capability() == (9, 0):  # the sm_90a TMA + wgmma kernel
        xs = torch.randn(2, 130, 40, device=dev).half()
        A = dbg.sym_gemm(xs, 0.01, 0.0, None)
        dbg.sym_gemm(A, 2.0315, -4.775, A)
    torch.cuda.synchronize()
    print("gpu_sanitize_case: ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
