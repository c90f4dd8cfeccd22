"""Which parameter goes to Muon and which to AdamW (and which AdamW params decay).

Rules, applied once per parameter *tensor* (tied/shared tensors are seen once):

1. Frozen (``requires_grad=False``): in neither branch; they are not trained.
2. An explicit role wins: ``_speedtronic_optimizer_role = "muon" | "adamw"`` on the parameter
   itself, or on the nearest module (owner first, then its ancestors) that registers it.
   ``"muon"`` still sends biases, gains and other non-matrix tensors to AdamW (Muon needs
   matrices); on a convolution it means "flatten this kernel onto Muon" (rule 5).
3. Embeddings and output heads go to AdamW: any module registering the tensor is an
   ``nn.Embedding``/``nn.EmbeddingBag`` (this catches heads tied to an embedding), has an
   embedding/head-like name (``lm_head``, ``wte``, ``embed_tokens``, ...), or, as a last resort,
   is a Linear whose ``out_features`` equals the vocabulary size of the model's largest
   embedding.
4. Hidden matrices go to Muon: 2-D weights of ``nn.Linear`` (and subclasses); Hugging Face
   ``Conv1D`` weights, stored ``(in, out)`` (layout ``transposed``: the lr scale uses the
   logical ``(out, in)`` shape); ``nn.MultiheadAttention.in_proj_weight`` and the fused ``qkv``
   Linear of the timm attention classes in ``_KNOWN_FUSED`` (layout ``split:3``: Q, K and V
   orthogonalized as three matrices); GPT-2's fused ``c_attn`` Conv1D (layout
   ``transposed_split:3``: its column blocks); any 2-D weight whose parameter or module sets
   ``_speedtronic_muon_split = K`` (K matrices stacked along the output dimension); pointwise
   (1x1, ungrouped) convolution weights, a Linear over channels (layout ``flatten``: viewed as
   ``(out, in)``).
5. Convolution kernels larger than 1x1 go to Muon flattened to ``(out, in*kh*kw)`` only when
   asked (``muon_conv=True``; config ``optimizer.muon_conv``): common practice for CNNs, but it
   changes what a kernel's update means. Grouped and depthwise convolutions (independent small
   filters, not one map), transposed convolutions and input convolutions (at most 4 input
   channels: they read pixels as an embedding reads tokens) stay on AdamW.
6. Everything else (norm gains, biases, raw ``nn.Parameter`` tensors) goes to AdamW; set
   ``_speedtronic_optimizer_role = "muon"`` on such a parameter to change that (on a module the
   role reaches every tensor it registers, so on a root model it would move the embedding and
   head as well).

AdamW params are split into decay / no-decay: tensors with fewer than 2 dims (biases, norm
gains) and embeddings/heads do not decay unless ``decay_norms_and_biases`` /
``decay_embeddings`` is set.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["ParameterRoutes", "route_parameters", "ROLE_ATTRIBUTE", "SPLIT_ATTRIBUTE",
           "describe_routing"]

ROLE_ATTRIBUTE = "_speedtronic_optimizer_role"
SPLIT_ATTRIBUTE = "_speedtronic_muon_split"
_VALID_ROLES = ("muon", "adamw")
_HEAD_NAMES = frozenset({
    "lm_head", "head", "output_head", "classifier", "score", "unembed", "embed_out",
})
_EMBEDDING_NAMES = frozenset({
    "embed", "embedding", "embeddings", "embed_tokens", "tok_embeddings", "word_embeddings",
    "wte", "wpe", "tok_emb", "pos_emb", "token_embedding", "position_embedding",
    # Input layers of vision models (a patchify or stem convolution reads raw pixels).
    "patch_embed", "patch_embeddings", "stem",
    # Learned tokens and position tables of vision transformers (timm's names).
    "pos_embed", "cls_token", "reg_token", "dist_token", "mask_token",
})
# Fused projections whose row layout was read in the library's source: (module, class of the
# owner, attribute name of the Linear, K). These timm classes reshape qkv's output as
# (3, heads, head_dim), so its rows are [Q; K; V] blocks. Not every timm "Attention" does: TinyViT
# lays qkv out per head, so classes are listed, not matched by name.
_KNOWN_FUSED = (
    ("timm.layers.attention", "Attention", "qkv", 3),
    ("timm.layers.attention", "AttentionRope", "qkv", 3),
    ("timm.models.vision_transformer", "Attention", "qkv", 3),
    ("timm.models.swin_transformer", "WindowAttention", "qkv", 3),
    ("timm.models.eva", "EvaAttention", "qkv", 3),
)


@dataclass
class ParameterRoutes:
    """Result of :func:`route_parameters`: ``(name, parameter)`` pairs per branch."""

    muon: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    adamw_decay: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    adamw_no_decay: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    """Parameter name -> why it went where it went (e.g. ``"adamw: embedding"``)."""
    layouts: dict[str, str] = field(default_factory=dict)
    """Muon parameter name -> ``"matrix"``, ``"transposed"``, ``"flatten"``, ``"split:K"`` or
    ``"transposed_split:K"`` (see :func:`speedtronic.optim.parse_layout`)."""
    hidden_unrouted: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    """AdamW tensors that are not embeddings or heads but Muon could have taken: 2-D matrices,
    and convolution kernels left off by ``muon_conv=False``."""

    @property
    def adamw(self) -> list[tuple[str, nn.Parameter]]:
        """All AdamW params (decay first)."""
        return self.adamw_decay + self.adamw_no_decay

    def __iter__(self) -> Iterator[list[nn.Parameter]]:
        """Unpack as ``muon, adamw = route_parameters(model)`` (lists of parameters)."""
        yield [p for _, p in self.muon]
        yield [p for _, p in self.adamw]

    def summary(self) -> str:
        """One line: tensor and element counts per branch."""
        def count(items: list[tuple[str, nn.Parameter]]) -> str:
            return f"{len(items)} tensors / {sum(p.numel() for _, p in items):,} params"
        return (f"muon {count(self.muon)}; adamw decay {count(self.adamw_decay)}; "
                f"adamw no-decay {count(self.adamw_no_decay)}; frozen {len(self.frozen)}")


def _role_of(obj: object, where: str) -> str | None:
    role = getattr(obj, ROLE_ATTRIBUTE, None)
    if role is not None and role not in _VALID_ROLES:
        raise ValueError(f"{where}.{ROLE_ATTRIBUTE} = {role!r} is not valid; use one of "
                         f"{', '.join(repr(r) for r in _VALID_ROLES)}")
    return role


def _vocab_size(model: nn.Module) -> int | None:
    sizes = [m.num_embeddings for m in model.modules()
             if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    return max(sizes) if sizes else None


def _named_like_head(mod_path: str, mod: nn.Module, leaf: str) -> bool:
    # "fc" only on the root model: torchvision's classifier head (ResNet, RegNet, Inception),
    # while many models also name hidden layers fc.
    return bool((set(mod_path.split(".")) | {leaf}) & _HEAD_NAMES) or mod_path == "fc"


def _named_like_embedding(mod_path: str, mod: nn.Module, leaf: str) -> bool:
    segments = set(mod_path.split(".")) | {leaf}
    return bool(segments & _EMBEDDING_NAMES) or "embedding" in type(mod).__name__.lower()


def _fallback_head(model: nn.Module, owners: dict[int, list[tuple[str, nn.Module, str]]],
                   vocab: int | None) -> int | None:
    """Last resort when no head is found by name or by tying: the last non-square Linear whose
    ``out_features`` equals the vocabulary size. Square ones are skipped: in toy models
    vocab == width, and a square hidden matrix must stay on Muon."""
    if vocab is None:
        return None
    for regs in owners.values():
        if any(_named_like_head(*reg) for reg in regs) or len(regs) > 1 and any(
                isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for _, m, _ in regs):
            return None
    candidate = None
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and mod.out_features == vocab != mod.in_features:
            candidate = id(mod.weight)
    return candidate


def route_parameters(model: nn.Module, *, decay_embeddings: bool = False,
                     decay_norms_and_biases: bool = False,
                     muon_conv: bool = False) -> ParameterRoutes:
    """Split ``model``'s trainable parameters into Muon / AdamW-decay / AdamW-no-decay.

    Every trainable tensor lands in exactly one list (see the module docstring for the rules).
    ``muon_conv``: also send convolution kernels larger than 1x1 to Muon, flattened.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    vocab = _vocab_size(model)
    # Every (module path, module, leaf name) that registers each tensor, in registration order.
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    first_name: dict[int, str] = {}
    tensors: dict[int, nn.Parameter] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for leaf, p in mod.named_parameters(recurse=False):
            key = id(p)
            full = f"{mod_name}.{leaf}" if mod_name else leaf
            owners.setdefault(key, []).append((mod_name, mod, leaf))
            first_name.setdefault(key, full)
            tensors[key] = p

    fallback_head = _fallback_head(model, owners, vocab)
    routes = ParameterRoutes()
    for key, p in tensors.items():
        name = first_name[key]
        if not p.requires_grad:
            routes.frozen.append(name)
            continue
        owner_path, _, _ = owners[key][0]
        role = _role_of(p, name)
        if role is None:
            # Nearest module first: the owner, then each ancestor up to the root.
            parts = owner_path.split(".") if owner_path else []
            for depth in range(len(parts), -1, -1):
                path = ".".join(parts[:depth])
                role = _role_of(modules[path], path or type(model).__name__)
                if role is not None:
                    break

        is_embedding = is_head = False
        for mod_path, mod, leaf in owners[key]:
            if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)):
                is_embedding = True
            if _named_like_head(mod_path, mod, leaf) or _named_like_embedding(mod_path, mod, leaf):
                is_head = True
            if key == fallback_head:
                is_head = True
        embedding_like = is_embedding or is_head
        linear_weight = any(isinstance(mod, nn.Linear) and leaf == "weight"
                            for _, mod, leaf in owners[key])
        layout, kind = _muon_layout(p, owners[key], muon_conv, modules, forced=role == "muon")
        matrix = p.ndim == 2 and p.is_floating_point()
        conv = _conv_kind(p, owners[key])

        if role == "muon" and matrix:
            branch, why = "muon", "muon: role override"
        elif role == "adamw":
            branch, why = "adamw", "adamw: role override"
        elif role is None and embedding_like:
            branch, why = "adamw", "adamw: embedding/head"
        elif role is None and matrix and linear_weight:
            branch, why = "muon", f"muon: {kind or 'hidden Linear matrix'}"
        elif role != "adamw" and kind is not None and (matrix or layout == "flatten"):
            branch, why = "muon", f"muon: {kind}"
        elif conv is not None:
            branch, why = "adamw", f"adamw: {conv}"
        else:
            branch = "adamw"
            why = ("adamw: bias/norm (<2 dims)" if p.ndim < 2 else
                   f"adamw: {p.ndim}-D tensor" if p.ndim != 2 else
                   "adamw: 2-D tensor not owned by nn.Linear (set a role to change)")

        if branch == "muon":
            routes.muon.append((name, p))
            routes.layouts[name] = layout
        else:
            if not embedding_like and (matrix or conv == _CONV_OPT_IN):
                routes.hidden_unrouted.append((name, tuple(p.shape)))
            if embedding_like:
                decay = decay_embeddings
            elif p.ndim < 2:
                decay = decay_norms_and_biases
            else:
                decay = True
            (routes.adamw_decay if decay else routes.adamw_no_decay).append((name, p))
            why += " (decay)" if decay else " (no decay)"
        routes.reasons[name] = why
    return routes


_CONV_OPT_IN = "conv kernel (optimizer.muon_conv: true flattens it onto Muon)"
_CONV_INPUT = "input conv (reads raw image channels)"


_INPUT_CHANNELS = 4
"""A convolution reading at most this many channels reads raw pixels (gray, RGB, RGBA): it is the
model's input layer (ResNet's ``conv1``, EfficientNet's ``conv_stem``, a ViT's patchify conv),
which stays on AdamW like an embedding."""


def _conv_kind(p: nn.Parameter, regs: list[tuple[str, nn.Module, str]]) -> str | None:
    """Why a convolution weight stays on AdamW (None: not a conv weight, or Muon may take it)."""
    for _, mod, leaf in regs:
        if not (isinstance(mod, nn.modules.conv._ConvNd) and leaf == "weight"):
            continue
        if mod.transposed:
            return "transposed convolution kernel"
        if mod.groups > 1:
            return "grouped/depthwise conv (independent filters, not one map)"
        if mod.in_channels <= _INPUT_CHANNELS:
            return _CONV_INPUT
        return _CONV_OPT_IN
    return None


def _known_fused(regs: list[tuple[str, nn.Module, str]], modules: dict[str, nn.Module]
                 ) -> int | None:
    for mod_path, mod, leaf in regs:
        if leaf != "weight" or not isinstance(mod, nn.Linear) or not mod_path:
            continue
        parent_path, _, attr = mod_path.rpartition(".")
        parent = modules.get(parent_path)
        for module, cls, name, k in _KNOWN_FUSED:
            if attr == name and parent is not None and type(parent).__name__ == cls \
                    and type(parent).__module__ == module and mod.out_features % k == 0:
                return k
    return None


def _known_fused_conv1d(p: nn.Parameter, regs: list[tuple[str, nn.Module, str]],
                        modules: dict[str, nn.Module]) -> int | None:
    """GPT-2's attention keeps Q, K, V (K, V for cross-attention) side by side in one Conv1D
    ``c_attn`` of shape ``(d, K d)``, and Hugging Face splits its output into equal blocks of
    ``d``. Recognized by the owner's class (``transformers``' ``GPT2Attention`` or a subclass,
    e.g. ``GPT2SdpaAttention`` in transformers 4.4x) and the attribute name."""
    for mod_path, _, leaf in regs:
        parent_path, _, attr = mod_path.rpartition(".")
        parent = modules.get(parent_path)
        if leaf == "weight" and attr == "c_attn" and parent is not None \
                and any(t.__name__ == "GPT2Attention" and t.__module__.startswith("transformers.")
                        for t in type(parent).__mro__) \
                and p.shape[1] > p.shape[0] and p.shape[1] % p.shape[0] == 0:
            return p.shape[1] // p.shape[0]
    return None


def _muon_layout(p: nn.Parameter, regs: list[tuple[str, nn.Module, str]],
                 muon_conv: bool = False, modules: dict[str, nn.Module] | None = None,
                 forced: bool = False) -> tuple[str, str | None]:
    """(layout, what it is) for a tensor Muon can take beyond plain ``nn.Linear`` weights;
    ``forced``: a ``"muon"`` role, which also takes input convs and larger kernels."""
    for _, mod, leaf in regs:
        if isinstance(mod, nn.modules.conv._ConvNd) and leaf == "weight" and p.ndim >= 3 \
                and not mod.transposed and mod.groups == 1 \
                and (mod.in_channels > _INPUT_CHANNELS or forced):
            if all(k == 1 for k in p.shape[2:]):
                return "flatten", "pointwise (1x1) conv, a Linear over channels"
            if muon_conv or forced:
                return "flatten", "conv kernel flattened to (out, in*k)"
        split = getattr(p, SPLIT_ATTRIBUTE, None) or (
            getattr(mod, SPLIT_ATTRIBUTE, None) if leaf == "weight" else None)
        conv1d = type(mod).__name__ == "Conv1D" and leaf == "weight" and p.ndim == 2
        if split is None and conv1d:
            split = _known_fused_conv1d(p, regs, modules or {})
        if split is not None and conv1d:
            if not isinstance(split, int) or split < 1 or p.shape[1] % split:
                raise ValueError(f"{SPLIT_ATTRIBUTE} = {split!r} does not split a Conv1D weight "
                                 f"of shape {tuple(p.shape)} (stored (in, out)) into equal "
                                 "column blocks")
            return (f"transposed_split:{split}",
                    f"fused Conv1D projection of {split} matrices stored (in, out)")
        if split is not None:
            if not isinstance(split, int) or split < 1 or p.ndim != 2 or p.shape[0] % split:
                raise ValueError(f"{SPLIT_ATTRIBUTE} = {split!r} does not split a tensor of "
                                 f"shape {tuple(p.shape)} into equal row blocks")
            return f"split:{split}", f"declared fused projection of {split} matrices"
        if isinstance(mod, nn.MultiheadAttention) and leaf == "in_proj_weight":
            return "split:3", "MultiheadAttention in_proj (Q, K, V)"
        if isinstance(mod, nn.MultiheadAttention) and leaf in ("q_proj_weight", "k_proj_weight",
                                                                "v_proj_weight"):
            return "matrix", f"MultiheadAttention {leaf[0].upper()} projection"
        if conv1d:
            return "transposed", "Conv1D matrix stored (in, out)"
        if isinstance(mod, nn.Linear) and leaf == "weight":
            fused = _known_fused(regs, modules or {})
            if fused is not None:
                return f"split:{fused}", f"known fused projection of {fused} matrices"
            return "matrix", None
    return "matrix", None


def describe_routing(model: nn.Module, **kwargs: bool) -> str:
    """A table of every trainable tensor: name, shape, branch and why (see the module docstring).

    ``kwargs`` go to :func:`route_parameters`; print the returned string.
    """
    routes = route_parameters(model, **kwargs)
    params = dict(model.named_parameters())
    rows = [("name", "shape", "layout", "why")]
    for name, why in routes.reasons.items():
        shape = "x".join(map(str, params[name].shape)) if name in params else "?"
        rows.append((name, shape, routes.layouts.get(name, "-"), why))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}"
             for r in rows]
    return "\n".join([*lines, routes.summary()])


def describe_routes(routes: ParameterRoutes) -> str:
    """Multi-line human summary: counts per reason."""
    counts = Counter(routes.reasons.values())
    return "\n".join(f"{n:4d}  {why}" for why, n in sorted(counts.items()))


def trainable_parameters(model: nn.Module) -> list[torch.nn.Parameter]:
    """Trainable parameters of ``model``, each tensor once."""
    seen: set[int] = set()
    out = []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
