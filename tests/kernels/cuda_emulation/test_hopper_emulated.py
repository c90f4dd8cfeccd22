"""Hopper (sm_90a) instructions in the CPU emulation, each checked against its PTX ISA
definition, and the TMA + wgmma symmetric GEMM (csrc/kernels/sym_gemm_sm90.cuh) run from its real
source under every schedule against PyTorch math.

The expected values here are computed in Python straight from the ISA's definitions (matrix
descriptor bit fields, swizzle = XOR of the 16-byte chunk index with address bits [7, ...),
wgmma accumulator fragment layout, mbarrier phase / tx-count rules, tensor-copy box packing with
zero fill), independently of the C++ emulation."""

from __future__ import annotations

import pytest
import torch
from _emu_fixtures import load_emulator

SCHEDULES = ("forward", "reverse", "random")


@pytest.fixture(scope="module")
def emu():
    return load_emulator()


@pytest.fixture(params=SCHEDULES)
def sched(request, emu):
    emu.configure(request.param, 4321)
    return request.param


# ------------------------------------------------------------------ ISA definitions, in Python
SPAN = {0: 0, 1: 128, 2: 64, 3: 32}  # descriptor swizzle field -> swizzle span in bytes


def swizzle(addr: int, span: int) -> int:
    """Swizzled shared address: the 16-byte chunk index (bits [4, 4+w)) XOR bits [7, 7+w),
    w = log2(span / 16): 128B -> bits 4-6 ^ 7-9, 64B -> 4-5 ^ 7-8, 32B -> 4 ^ 7."""
    if span == 0:
        return addr
    mask = span // 16 - 1
    return addr ^ (((addr >> 7) & mask) << 4)


def descriptor(start: int, lbo: int, sbo: int, mode: int) -> int:
    """64-bit wgmma matrix descriptor: [0,14) start>>4, [16,30) LBO>>4, [32,46) SBO>>4,
    [62,64) swizzle mode (0 none, 1 128B, 2 64B, 3 32B)."""
    d = (
        ((start & 0x3FFFF) >> 4)
        | ((lbo >> 4) & 0x3FFF) << 16
        | ((sbo >> 4) & 0x3FFF) << 32
        | mode << 62
    )
    return d - (1 << 64) if d >= 1 << 63 else d  # as a signed int64 for the op schema


def place_k_major(
    image: torch.Tensor, base: int, mat: torch.Tensor, mode: int, lbo: int, sbo: int, window: int
) -> None:
    """Write a (rows, K) 16-bit K-major matrix into `image` (bytes at window address `window`..)
    at `base` in the canonical layout of the descriptor mode."""
    bits = mat.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    span = SPAN[mode]
    for r in range(mat.shape[0]):
        for k in range(mat.shape[1]):
            kb = 2 * k
            if mode == 0:  # 8 x 16-byte core matrices: LBO along K, SBO along rows
                a = base + (r // 8) * sbo + (kb // 16) * lbo + (r % 8) * 16 + kb % 16
            else:  # 8-row atoms of `span`-byte rows, SBO apart, swizzled on the address bits
                a = swizzle(base + (r // 8) * sbo + (r % 8) * span + kb, span)
            v = int(bits[r, k])
            image[a - window] = v & 0xFF
            image[a - window + 1] = v >> 8


def fragment_to_matrix(frag: torch.Tensor, n: int) -> torch.Tensor:
    """wgmma m64nNk16 f32 accumulator: thread t (warp w = t // 32, lane l), register i holds
    D[16 w + l // 4 + 8 ((i >> 1) & 1)][8 (i >> 2) + 2 (l % 4) + (i & 1)]."""
    D = torch.full((64, n), float("nan"))
    for t in range(128):
        w, lane = divmod(t, 32)
        for i in range(n // 2):
            D[16 * w + lane // 4 + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * (lane % 4) + (i & 1)] = (
                frag[t, i]
            )
    return D


def frag_from_matrix(D: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.empty(128, n // 2)
    for t in range(128):
        w, lane = divmod(t, 32)
        for i in range(n // 2):
            out[t, i] = D[
                16 * w + lane // 4 + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * (lane % 4) + (i & 1)
            ]
    return out


# ------------------------------------------------------------------ wgmma.mma_async
@pytest.mark.parametrize(
    "mode,n,dt",
    [
        (1, 128, torch.bfloat16),
        (2, 64, torch.float16),
        (3, 32, torch.bfloat16),
        (0, 16, torch.float16),
        (0, 256, torch.bfloat16),
    ],
)
def test_wgmma_descriptors_swizzle_and_fragments(emu, mode, n, dt):
    emu.configure("random", 1)
    window = emu.hopper_smem_base()
    gen = torch.Generator().manual_seed(10 + mode)
    span = SPAN[mode]
    # Swizzled: a K-major tile as wide as the span; the k16 slice starts `koff` bytes into it
    # (the kernel's k steps). No swizzle: core matrices, LBO and SBO chosen unequal.
    width = span // 2 if span else 16
    A = torch.randn(64, width, generator=gen).to(dt)
    B = torch.randn(n, width, generator=gen).to(dt)
    a_base, b_base = 4096, 4096 + 64 * max(span, 32) * 2
    b_base = (b_base + 1023) // 1024 * 1024
    image = torch.zeros(b_base + n * max(span, 32) * 2 - window, dtype=torch.uint8)
    if span:
        sbo = 8 * span
        place_k_major(image, a_base, A, mode, 16, sbo, window)
        place_k_major(image, b_base, B, mode, 16, sbo, window)
        koff = 32 * (width // 16 - 1)  # last k16 slice of the row
        da, db = descriptor(a_base + koff, 16, sbo, mode), descriptor(b_base + koff, 16, sbo, mode)
        ks = slice(koff // 2, koff // 2 + 16)
    else:
        place_k_major(image, a_base, A, 0, 128, 256, window)
        place_k_major(
            image, b_base, B, 0, (n // 8) * 128, 128, window
        )  # K-adjacent cores far apart
        da, db = descriptor(a_base, 128, 256, 0), descriptor(b_base, (n // 8) * 128, 128, 0)
        ks = slice(0, 16)
    D0 = torch.randn(64, n, generator=gen)
    want = A[:, ks].float() @ B[:, ks].float().T
    for scale_d, repeat in [(True, 1), (False, 1), (True, 2)]:
        out = emu.probe_wgmma(
            image, da, db, n, dt == torch.bfloat16, scale_d, repeat, frag_from_matrix(D0, n)
        )
        D = fragment_to_matrix(out, n)
        ref = (D0 if scale_d else 0) + repeat * want
        torch.testing.assert_close(
            D, ref, rtol=1e-5, atol=1e-4, msg=f"scale_d={scale_d} repeat={repeat}"
        )


def test_wgmma_wait_group_completes_all_but_the_newest_n(emu, sched):
    """wait_group(1) with two committed groups completes the older only (the newer's registers
    still read NaN here: undefined on hardware); wait_group(0) completes both."""
    window = emu.hopper_smem_base()
    gen = torch.Generator().manual_seed(60)
    A = torch.randn(64, 16, generator=gen).to(torch.bfloat16)
    B = torch.randn(16, 16, generator=gen).to(torch.bfloat16)
    image = torch.zeros(8192, dtype=torch.uint8)
    place_k_major(image, 1024, A, 0, 128, 256, window)
    place_k_major(image, 4096, B, 0, 128, 256, window)
    out = emu.probe_wgmma_groups(
        image, descriptor(1024, 128, 256, 0), descriptor(4096, 128, 256, 0)
    )
    D = A.float() @ B.float().T
    first = torch.tensor(
        [D[16 * (t // 32) + (t % 32) // 4, 2 * (t % 4)].item() for t in range(128)]
    )
    torch.testing.assert_close(out[:, 0], first, rtol=1e-5, atol=1e-5)
    assert out[:, 1].isnan().all()
    torch.testing.assert_close(out[:, 2], first, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, 3], 2 * first, rtol=1e-5, atol=1e-5)


def test_wgmma_misuse_is_reported(emu):
    emu.configure("forward", 0)
    with pytest.raises(RuntimeError, match="wgmma.fence"):
        emu.run_hopper_bug("no_fence")
    with pytest.raises(RuntimeError, match="different operands"):
        emu.run_hopper_bug("divergent_desc")
    with pytest.raises(RuntimeError, match="in flight"):
        emu.run_hopper_bug("exit_in_flight")
    # Reading the accumulator before wgmma.wait_group: undefined on hardware, NaN here.
    assert emu.run_hopper_bug("early_read").isnan().all()


# ------------------------------------------------------------------ mbarrier
def test_mbarrier_phase_and_tx_count(emu):
    emu.configure("forward", 0)
    INIT, ARRIVE, ARRIVE_TX, COMPLETE_TX, TEST, EXPECT_TX = range(6)
    # fmt: off
    script = [
        INIT, 2,
        TEST, 0, TEST, 1,            # phase 0 in progress; "previous" parity 1 counts as done
        ARRIVE, 0, TEST, 0,          # 1 of 2 arrivals
        ARRIVE_TX, 100, TEST, 0,     # arrivals done, but 100 tx bytes pending
        COMPLETE_TX, 60, TEST, 0,
        COMPLETE_TX, 40, TEST, 0, TEST, 1,  # tx 0 and no arrivals pending: phase 0 completes
        COMPLETE_TX, 50, TEST, 1,    # phase 1: complete_tx may precede expect_tx (tx = -50)
        EXPECT_TX, 50, ARRIVE, 0, TEST, 1,  # tx back to 0, one arrival left
        ARRIVE, 0, TEST, 1, TEST, 0,  # phase 1 completes: parity 1 done, parity 0 (phase 2) not
    ]
    # fmt: on
    assert emu.probe_mbar(script) == [0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0]
    with pytest.raises(RuntimeError, match="not initialized"):
        emu.probe_mbar([ARRIVE, 0])
    with pytest.raises(RuntimeError, match="count"):
        emu.probe_mbar([INIT, 0])


def test_mbarrier_wait_that_never_completes_is_a_deadlock(emu):
    emu.configure("forward", 0)
    with pytest.raises(RuntimeError, match="deadlock.*mbarrier"):
        emu.run_hopper_bug("mbar_deadlock")


# ------------------------------------------------------------------ cp.async.bulk.tensor
@pytest.mark.parametrize(
    "swz,box,coords",
    [
        (128, (64, 16, 1), (0, 0, 0)),
        (128, (64, 16, 2), (40, 27, 1)),  # crosses the end of K, of the rows and of the batch
        (64, (32, 8, 1), (-8, -3, 0)),  # negative coordinates: zero fill before the start
        (32, (16, 8, 1), (8, 5, 2)),
        (0, (24, 5, 2), (3 * 8, 30, 0)),
    ],
)
def test_tma_box_zero_fill_and_swizzle(emu, sched, swz, box, coords):
    gen = torch.Generator().manual_seed(20)
    big = torch.randn(3, 35, 104, generator=gen).to(torch.bfloat16)
    G = big[:, :, :88]  # row stride 104 elements (208 bytes, a multiple of 16), K = 88
    dst = 2048
    out = emu.probe_tma(G, list(box), list(coords), swz, dst)
    bits = G.view(torch.int16).to(torch.int32) & 0xFFFF
    want = torch.zeros(box[0] * box[1] * box[2] * 2, dtype=torch.uint8)
    e = 0
    for i2 in range(box[2]):
        for i1 in range(box[1]):
            for i0 in range(box[0]):
                g0, g1, g2 = coords[0] + i0, coords[1] + i1, coords[2] + i2
                inside = 0 <= g0 < G.shape[2] and 0 <= g1 < G.shape[1] and 0 <= g2 < G.shape[0]
                v = int(bits[g2, g1, g0]) if inside else 0
                at = swizzle(dst + 2 * e, swz) - dst
                want[at], want[at + 1] = v & 0xFF, v >> 8
                e += 1
    assert torch.equal(out, want)


def test_tensor_map_encoding_checks(emu):
    emu.configure("forward", 0)
    G = torch.zeros(1, 8, 36, dtype=torch.float16)  # row stride 72 bytes: not a multiple of 16
    with pytest.raises(RuntimeError, match="multiples of 16"):
        emu.probe_tma(G, [16, 8, 1], [0, 0, 0], 0, 1024)
    G = torch.zeros(1, 8, 128, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="swizzle span"):
        emu.probe_tma(G, [128, 8, 1], [0, 0, 0], 128, 1024)  # 256-byte inner box > 128B span


# ------------------------------------------------------------------ pipeline hazards
def test_emulator_exposes_pipeline_hazards(emu):
    """A 2-stage TMA -> wgmma ring: right under every schedule; a stage handed back before its
    wgmma completed, or consumed without waiting on its mbarrier, shows up under some schedule."""
    gen = torch.Generator().manual_seed(50)
    X = torch.randn(128, 64 * 5, generator=gen).to(torch.bfloat16)
    ref = X[:64].float() @ X.float().T

    def run(mode: int, schedule: str) -> bool:
        emu.configure(schedule, 11)
        try:
            D = fragment_to_matrix(emu.probe_pipeline(X, mode), 128)
        except RuntimeError:
            return False
        return torch.allclose(D, ref, rtol=1e-4, atol=1e-3)

    assert all(run(0, s) for s in SCHEDULES)
    assert not all(run(1, s) for s in SCHEDULES), "early release went unnoticed"
    assert not all(run(2, s) for s in SCHEDULES), "a missing mbarrier wait went unnoticed"


# ------------------------------------------------------------------ the kernel
def _check_sym(out: torch.Tensor, ref: torch.Tensor, dt: torch.dtype, what: str) -> None:
    assert out.dtype == dt and out.shape == ref.shape, what
    assert not out.isnan().any(), f"{what}: NaN (an element was not written or read poisoned smem)"
    assert torch.equal(out, out.mT), f"{what}: output not exactly symmetric"
    tol = 1e-2 if dt == torch.bfloat16 else 2e-3
    torch.testing.assert_close(
        out.float(),
        ref,
        rtol=tol,
        atol=tol * ref.abs().max().item() + 1e-6,
        msg=lambda m: f"{what}: {m}",
    )


@pytest.mark.parametrize(
    "b,m,k,tile_n",
    [
        (1, 1, 8, 0),  # one element
        (7, 37, 40, 0),  # batch 7, k < one stage (64)
        (1, 130, 72, 0),  # m just past one tile
        (2, 200, 328, 128),  # k over 4 stages: the ring wraps; 3 blocks walk 6 items
        (1, 300, 24, 256),  # 256-wide macro tiles; one row half lies below the matrix
        (3, 129, 264, 0),  # 9 items over 3 persistent blocks, 5 k-blocks each
    ],
)
def test_sym_gemm_kernel_matches_torch(emu, sched, b, m, k, tile_n):
    emu.set_sm_count(3)
    gen = torch.Generator().manual_seed(30 + m)
    for dt in (torch.bfloat16, torch.float16):
        X = torch.randn(b, m, k, generator=gen).to(dt)
        ref = X.float() @ X.float().mT
        out = emu.sym_gemm(X, 1.0, 0.0, None, tile_n)
        _check_sym(out, ref, dt, f"XX^T {dt}")
        # alpha X X^T + beta C, and the NS polynomial b A + c A^2 (A symmetric: A^2 = A A^T)
        out2 = emu.sym_gemm(X, -0.5, 2.0, out, tile_n)
        _check_sym(out2, 2.0 * out.float() - 0.5 * ref, dt, f"alpha/beta {dt}")
        if m == k or m <= 64:
            A = out / out.float().abs().amax().clamp_min(1e-3).to(dt)
            poly = emu.sym_gemm(A, -4.7750, 3.4445, A, tile_n)
            _check_sym(
                poly, 3.4445 * A.float() - 4.7750 * (A.float() @ A.float()), dt, f"bA+cA^2 {dt}"
            )


def test_sym_gemm_awkward_layouts(emu):
    emu.configure("random", 5)
    emu.set_sm_count(2)
    gen = torch.Generator().manual_seed(40)
    X = torch.randn(3, 70, 50, generator=gen).to(torch.bfloat16)[:, :, 3:36]  # k = 33, misaligned
    out = emu.sym_gemm(X, 1.0, 0.0, None, 0)
    _check_sym(out, X.float() @ X.float().mT, torch.bfloat16, "strided k=33")
    X2 = torch.randn(45, 16, generator=gen).to(torch.float16)  # 2-D input
    out2 = emu.sym_gemm(X2, 0.25, 0.0, None, 0)
    _check_sym(out2, 0.25 * X2.float() @ X2.float().T, torch.float16, "2-D")
    empty = emu.sym_gemm(
        torch.zeros(2, 5, 0, dtype=torch.bfloat16),
        1.0,
        0.5,
        torch.ones(2, 5, 5, dtype=torch.bfloat16),
        0,
    )
    assert torch.equal(empty, torch.full((2, 5, 5), 0.5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="tile_n"):
        emu.sym_gemm(X2, 1.0, 0.0, None, 64)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        emu.sym_gemm(X2.float(), 1.0, 0.0, None, 0)
