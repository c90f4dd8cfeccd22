"""Model-zoo rows from timm, built from tiny configs (no downloads): a ViT (fused qkv Linear,
split into Q, K and V) and a ConvNeXt (pointwise convs on Muon, its 2x2 downsampling kernels with
``muon_conv``; depthwise 7x7 convs and the stem on AdamW). Same check as the Hugging Face rows.

timm imports torchvision, and torchvision's PyPI wheels link the CUDA build of torch, so these
rows skip in the CPU dev venv; CI runs them in its CUDA-torch venv (which imports without a GPU,
.ci/run). SPEEDTRONIC_REQUIRE_TIMM=1 turns the skip into a failure there."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("SPEEDTRONIC_REQUIRE_TIMM") == "1":
    import timm
else:
    timm = pytest.importorskip("timm", exc_type=ImportError)

from _zoo_fixtures import check_zoo_model  # noqa: E402

from speedtronic.optim import route_parameters  # noqa: E402


def _vit():
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                             patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=3)


def _convnext():
    return timm.create_model("convnext_atto", pretrained=False, depths=(1, 1, 1, 1),
                             dims=(8, 16, 16, 24), num_classes=3)


def _loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 3, (4,), generator=g)
    return torch.nn.functional.cross_entropy(model(x), y)


def test_timm_vit():
    # per block: qkv (split:3), proj, fc1, fc2
    check_zoo_model(_vit, _loss, {"split:3": 2, "matrix": 6})


def test_timm_convnext_with_muon_conv():
    # per block: fc1, fc2 (1x1 convs); plus the 2x2 downsampling convs of stages 2-4
    check_zoo_model(_convnext, _loss, {"flatten": 11}, muon_conv=True)


def test_timm_vit_qkv_is_three_matrices():
    routes = route_parameters(_vit())
    assert routes.layouts["blocks.0.attn.qkv.weight"] == "split:3"
    assert "patch_embed.proj.weight" not in routes.layouts  # the patchify conv stays on AdamW
