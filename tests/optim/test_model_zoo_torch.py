"""Model-zoo rows built from torch.nn alone: nn.TransformerEncoder (fused in_proj_weight, split
into Q, K and V) and a small CNN (pointwise convs on Muon by default, 3x3 kernels with
``muon_conv``, the depthwise conv and the stem on AdamW). Same check as the Hugging Face rows."""

from __future__ import annotations

import torch
from _zoo_fixtures import check_zoo_model
from torch import nn

from speedtronic.optim import Muon, route_parameters


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64,
                                           batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 50)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)))  # (B, T, V)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.conv = nn.Conv2d(16, 16, 3, padding=1)
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.pointwise = nn.Conv2d(16, 32, 1)
        self.classifier = nn.Linear(32, 5)

    def forward(self, x):                      # (B, 3, H, W)
        x = torch.relu(self.conv(torch.relu(self.stem(x))))
        x = self.pointwise(torch.relu(self.depthwise(x)))   # (B, 32, H, W)
        return self.classifier(x.mean(dim=(2, 3)))          # (B, 5)


def _encoder_loss(model, seed):
    ids = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(seed))
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def _cnn_loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)
    return nn.functional.cross_entropy(model(x), y)


def test_transformer_encoder():
    # per layer: in_proj (split:3), out_proj, linear1, linear2
    check_zoo_model(Encoder, _encoder_loss, {"split:3": 2, "matrix": 6})


def test_cnn_with_muon_conv():
    check_zoo_model(SmallCNN, _cnn_loss, {"flatten": 2}, muon_conv=True)


def test_cnn_default_keeps_kernels_on_adamw_and_says_so():
    routes = route_parameters(SmallCNN())
    assert routes.layouts == {"pointwise.weight": "flatten"}
    assert routes.hidden_unrouted == [("conv.weight", (16, 16, 3, 3))]
    assert "muon_conv" in routes.reasons["conv.weight"]
    assert "depthwise" in routes.reasons["depthwise.weight"]
    assert "embedding/head" in routes.reasons["stem.weight"]


def test_conv_role_and_transposed_convs():
    model = nn.Sequential(nn.Conv2d(4, 4, 3), nn.ConvTranspose2d(4, 4, 3), nn.Conv1d(4, 8, 5))
    model[2]._speedtronic_optimizer_role = "muon"
    routes = route_parameters(model)
    assert routes.layouts == {"2.weight": "flatten"}  # the role wins, flattened
    assert "transposed convolution" in routes.reasons["1.weight"]
    assert routes.reasons["2.bias"].startswith("adamw")


def test_flatten_layout_equals_muon_on_the_flattened_matrix():
    torch.manual_seed(0)
    w, g = torch.randn(8, 4, 3, 3), torch.randn(8, 4, 3, 3)
    a = nn.Parameter(w.clone())
    b = nn.Parameter(w.reshape(8, 36).clone())
    a.grad, b.grad = g.clone(), g.reshape(8, 36).clone()
    for _ in range(2):
        Muon([{"params": [a], "layout": "flatten"}], lr=0.1, weight_decay=0.01,
             ns_dtype="fp32").step()
        Muon([b], lr=0.1, weight_decay=0.01, ns_dtype="fp32").step()
    torch.testing.assert_close(a.detach().reshape(8, 36), b.detach(), rtol=0, atol=0)


def test_flatten_layout_steps_a_channels_last_kernel_like_a_contiguous_one():
    """A conv kernel in channels_last memory format goes through a contiguous copy: the same
    update bit for bit, momentum included, and the parameter keeps its memory format."""
    torch.manual_seed(0)
    w = torch.randn(8, 4, 3, 3)
    last = nn.Parameter(w.clone().to(memory_format=torch.channels_last))
    dense = nn.Parameter(w.clone())
    assert not last.is_contiguous()
    opts = [Muon([{"params": [q], "layout": "flatten"}], lr=0.1, weight_decay=0.01,
                 ns_dtype="fp32") for q in (last, dense)]
    for _ in range(3):
        g = torch.randn(8, 4, 3, 3)
        last.grad = g.clone().to(memory_format=torch.channels_last)
        dense.grad = g.clone()
        for opt in opts:
            opt.step()
    torch.testing.assert_close(last.detach(), dense.detach(), rtol=0, atol=0)
    assert last.is_contiguous(memory_format=torch.channels_last)


class ResNetLike(nn.Module):
    """No helpful names: the input conv is found by its 3 input channels."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 7, stride=2, padding=3)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc(self.conv2(torch.relu(self.conv1(x))).mean(dim=(2, 3)))


def test_the_input_conv_stays_on_adamw_even_with_muon_conv():
    routes = route_parameters(ResNetLike(), muon_conv=True)
    assert routes.layouts == {"conv2.weight": "flatten"}
    assert "input conv" in routes.reasons["conv1.weight"]
    assert "embedding/head" in routes.reasons["fc.weight"]  # torchvision's classifier name
    assert not routes.hidden_unrouted


def test_known_fused_layouts_are_matched_by_class_not_by_name():
    def owner(module: str, name: str) -> type:
        return type(name, (nn.Module,), {"__module__": module})

    def routed(cls: type, attr: str, layer: nn.Module) -> str:
        parent = cls()
        setattr(parent, attr, layer)
        return route_parameters(nn.Sequential(parent)).layouts[f"0.{attr}.weight"]

    timm_attention = owner("timm.layers.attention", "Attention")
    tiny_vit_attention = owner("timm.models.tiny_vit", "Attention")  # qkv laid out per head
    assert routed(timm_attention, "qkv", nn.Linear(16, 48)) == "split:3"
    assert routed(tiny_vit_attention, "qkv", nn.Linear(16, 48)) == "matrix"

    class Conv1D(nn.Module):  # Hugging Face's layer, recognized by its class name
        def __init__(self, nf: int, nx: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(nx, nf))

    gpt2 = owner("transformers.models.gpt2.modeling_gpt2", "GPT2Attention")
    sdpa = type("GPT2SdpaAttention", (gpt2,), {"__module__": gpt2.__module__})  # 4.4x subclass
    assert routed(sdpa, "c_attn", Conv1D(48, 16)) == "transposed_split:3"
