"""One optimizer object for the whole model: :class:`HybridOptimizer` and :func:`build_optimizer`.

``HybridOptimizer`` is a plain ``torch.optim.Optimizer`` whose param groups carry a ``"kind"``
key (``"muon"`` or ``"adamw"``) next to that branch's hyperparameters. Because it *is* the
optimizer (no child optimizers, no shared-state tricks), everything built on
``torch.optim.Optimizer`` just works: ``LambdaLR`` scales every group's ``lr`` (keeping the
Muon/AdamW ratio), ``OneCycleLR``/``CyclicLR`` cycle Muon's momentum and AdamW's beta1 (see
:class:`HybridOptimizer`), ``state_dict``/``load_state_dict`` hold both branches,
``torch.save``/``torch.load(weights_only=True)`` round-trips (state holds only tensors; groups
only numbers, strings, lists and None), ``zero_grad`` clears everything.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..config import OptimizerConfig, load_config
from ._state import (
    EagerMethodsMixin,
    Fp32StateMixin,
    checked_or_dropped,
    fill_group_defaults,
    run_closure,
)
from .adamw import ADAMW_DEFAULTS, adamw_step, fused_supported, refuse_sparse_grads
from .adamw import _check_group as _check_adamw_group
from .muon import MuonCacheMixin, check_cuda_graph
from .muon_groups import MUON_DEFAULTS
from .muon_groups import _check_group as _check_muon_group
from .muon_step import tensorize_hyper
from .routing import route_parameters, trainable_parameters

__all__ = ["HybridOptimizer", "build_optimizer"]

logger = logging.getLogger("speedtronic.optim")

_KIND_DEFAULTS = {"muon": MUON_DEFAULTS, "adamw": ADAMW_DEFAULTS}


class HybridOptimizer(MuonCacheMixin, Fp32StateMixin, EagerMethodsMixin, torch.optim.Optimizer):
    """Muon and AdamW param groups in one optimizer.

    Args:
        param_groups: dicts with ``"params"`` and ``"kind"`` (``"muon"`` or ``"adamw"``); missing
            hyperparameters take :data:`speedtronic.optim.muon_groups.MUON_DEFAULTS` /
            :data:`speedtronic.optim.adamw.ADAMW_DEFAULTS`.

    ``step()`` runs every Muon group together (same-shape matrices share one batched
    Newton-Schulz call), then each AdamW group. :meth:`reset_state` drops all inner state
    (momentum, Adam moments, steps) of both branches, e.g. at a DiLoCo outer step.

    Momentum-cycling schedulers (``OneCycleLR``, ``CyclicLR``) write one key, ``momentum``, to
    every group: ``defaults`` declares it, Muon groups use it as theirs, and an AdamW group
    whose ``momentum`` is set (it is None until a scheduler writes it) takes it as beta1, which
    is what those schedulers do to a plain AdamW.
    """

    def __init__(self, param_groups: list[dict[str, Any]], *, cuda_graph: bool | str = False,
                 workspace_budget: int | None = None, process_group: Any = None) -> None:
        if not param_groups:
            raise ValueError("HybridOptimizer needs at least one param group")
        self.cuda_graph = check_cuda_graph(cuda_graph, process_group)  # see optim.Muon
        self.workspace_budget = workspace_budget
        self.process_group = process_group  # sharded Newton-Schulz (speedtronic.optim.Muon)
        self._new_muon_cache()
        super().__init__(param_groups, defaults={"momentum": None})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The group needs ``kind`` (``muon`` or ``adamw``), whose defaults fill the hyperparameters
        it lacks; it is then checked by that branch's rules, as in :class:`Muon` and
        :class:`AdamW` (a rejected group is removed again), and a Muon group's ``lr``,
        ``weight_decay`` and ``momentum`` become 0-d tensors."""
        kind = param_group.get("kind")
        if kind not in _KIND_DEFAULTS:
            raise ValueError(f"param group 'kind' must be 'muon' or 'adamw', got {kind!r}: "
                             "each group is a dict such as {'params': [...], 'kind': 'muon', "
                             "'lr': 0.02} (speedtronic 2.0's HybridOptimizer(muon_params, "
                             "adamw_params, ...) is two such groups, or build_optimizer(model))")
        group = {**_KIND_DEFAULTS[kind], **param_group}
        super().add_param_group(group)
        checked_or_dropped(self.param_groups,
                           _check_muon_group if kind == "muon" else _check_adamw_group)
        if kind == "muon" and self.param_groups[-1].get("kind") == "muon":
            tensorize_hyper(self.param_groups[-1])

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A state dict of an older version may lack keys added since; fill them per kind.
        super().__setstate__(state)
        fill_group_defaults(self.param_groups,
                            lambda group: _KIND_DEFAULTS.get(group.get("kind"), {}))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, after checking that the saved groups have this optimizer's kinds in order
        (another ``optimizer.name`` or model raises ValueError). fp32 state stays fp32 and the
        cached Muon step plan is dropped, so the next step reads the loaded momentum."""
        saved = [g.get("kind") for g in state_dict.get("param_groups", [])]
        mine = [g["kind"] for g in self.param_groups]
        if saved != mine:
            raise ValueError(f"optimizer state has param groups {saved} but this optimizer has "
                             f"{mine}; was the checkpoint written with a different "
                             "optimizer.name or model?")
        super().load_state_dict(state_dict)

    def reset_state(self) -> None:
        """Clear the inner state of both branches (keeps hyperparameters and the lr): the next
        step starts Muon's momentum and AdamW's moments at zero, as a fresh optimizer would."""
        self.state.clear()
        self.drop_muon_plan()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Perform one optimization step over both branches."""
        loss = run_closure(closure)
        muon_groups = [g for g in self.param_groups if g["kind"] == "muon"]
        adamw_groups = [g for g in self.param_groups if g["kind"] == "adamw"]
        # AdamW refuses a sparse gradient only when its group's turn comes: checked for every
        # group first, as an error there left the Muon matrices and earlier groups updated and
        # the rest not (a half-applied step)
        refuse_sparse_grads(adamw_groups)
        if muon_groups:
            self.run_muon_step(self.state, muon_groups)
        for group in adamw_groups:
            beta1 = group.get("momentum")  # set only by a momentum-cycling scheduler
            if beta1 is not None and group["betas"][0] != beta1:
                group["betas"] = (beta1, group["betas"][1])
            adamw_step(self.state, group)
        return loss


def _adamw_group(params: list, cfg: OptimizerConfig, weight_decay: float, tag: str) -> dict:
    return {"kind": "adamw", "name": tag, "params": params, "lr": cfg.lr,
            "betas": tuple(cfg.betas), "eps": cfg.eps, "weight_decay": weight_decay,
            "fused": cfg.fused, "cautious": cfg.cautious, "cautious_rescale": cfg.cautious_rescale}


def _warn_if_under_routed(routes: Any) -> None:
    """A "muon" run that trains most hidden matrices with AdamW is not what was asked for: say
    which tensors, and how to route them."""
    on_muon = sum(p.numel() for _, p in routes.muon)
    shapes = sorted(routes.hidden_unrouted, key=lambda item: -_numel(item[1]))
    off = sum(_numel(s) for _, s in shapes)
    if off and on_muon < off:
        largest = ", ".join(f"{n} {'x'.join(map(str, s))}" for n, s in shapes[:5])
        logger.warning("optimizer: only %.0f%% of the hidden-matrix parameters are on Muon; the "
                       "largest on AdamW: %s. Set _speedtronic_optimizer_role = 'muon' on "
                       "each of those parameters (on a module it reaches every parameter "
                       "below it: on the root model that moves the embedding and head too), "
                       "or _speedtronic_muon_split = K for a fused projection; "
                       "optimizer.muon_conv: true for convolution kernels; "
                       "speedtronic.optim.describe_routing(model) prints the whole table",
                       100.0 * on_muon / (on_muon + off), largest)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def build_optimizer(model: nn.Module,
                    config: OptimizerConfig | Mapping[str, Any] | str | None = None, *,
                    process_group: Any = None) -> HybridOptimizer:
    """Build the one optimizer covering every trainable parameter of ``model``.

    ``config.name == "adamw"``: AdamW over ALL trainable parameters (matrices decay; norms,
    biases and embeddings only if ``decay_norms_and_biases`` / ``decay_embeddings``).
    ``config.name == "muon"``: hidden matrices on Muon (``muon_lr``, ``muon_weight_decay``, ...),
    the rest on AdamW (``lr``, ``weight_decay``), routed by
    :func:`speedtronic.optim.route_parameters`. Logs one line per decision.
    ``process_group``: under data parallelism, split the Muon step's Newton-Schulz across its
    ranks (:mod:`speedtronic.optim.sharded`). ``config`` may also be the YAML section as a
    dict (``{"name": "muon", "muon_lr": 0.02}``) or its shorthand (``"muon"``), checked as the
    config loader checks it.
    """
    if config is None:
        cfg = OptimizerConfig()
    elif isinstance(config, (Mapping, str)):
        cfg = load_config({"optimizer": config if isinstance(config, str) else dict(config)
                           }).optimizer
    elif isinstance(config, OptimizerConfig):
        cfg = config
    else:
        raise TypeError(f"build_optimizer: config must be an OptimizerConfig, a dict of its "
                        f"keys or a name ('muon', 'adamw'), got {type(config).__name__}")
    cfg.validate()
    if not trainable_parameters(model):
        raise ValueError("model has no trainable parameters (every parameter has "
                         "requires_grad=False); nothing to optimize")
    routes = route_parameters(model, decay_embeddings=cfg.decay_embeddings,
                              decay_norms_and_biases=cfg.decay_norms_and_biases,
                              muon_conv=cfg.muon_conv)
    groups: list[dict[str, Any]] = []
    if cfg.name == "muon":
        by_layout: dict[str, list[nn.Parameter]] = {}
        for name, p in routes.muon:
            by_layout.setdefault(routes.layouts.get(name, "matrix"), []).append(p)
        for layout, params in by_layout.items():
            groups.append({
                "kind": "muon", "layout": layout,
                "name": "muon" if layout == "matrix" else f"muon_{layout.replace(':', '')}",
                "params": params,
                "lr": cfg.muon_lr, "weight_decay": cfg.muon_weight_decay,
                "momentum": cfg.muon_momentum, "nesterov": cfg.muon_nesterov,
                "ns_coefficients": (cfg.muon_coefficients if isinstance(cfg.muon_coefficients, str)
                                    else [float(c) for c in cfg.muon_coefficients]),
                "eps": cfg.muon_eps, "ns_steps": cfg.muon_ns_steps,
                "adjust_lr_fn": cfg.muon_adjust_lr, "muon_plus": cfg.muon_plus,
                "norm_eps": cfg.muon_norm_eps, "cautious": cfg.cautious,
                "cautious_rescale": cfg.cautious_rescale, "ns_dtype": cfg.muon_ns_dtype,
            })
        if not routes.muon:
            logger.info("optimizer: muon requested but the model has no hidden Linear matrices; "
                        "every parameter uses AdamW")
        _warn_if_under_routed(routes)
        decay = [p for _, p in routes.adamw_decay]
    else:
        # Everything trainable, hidden matrices included (v2 left them untrained: defect 5.1 #1).
        decay = [p for _, p in routes.muon] + [p for _, p in routes.adamw_decay]
    no_decay = [p for _, p in routes.adamw_no_decay]
    if decay:
        groups.append(_adamw_group(decay, cfg, cfg.weight_decay, "adamw_decay"))
    if no_decay:
        groups.append(_adamw_group(no_decay, cfg, 0.0, "adamw_no_decay"))
    opt = HybridOptimizer(groups, cuda_graph={"on": True, "off": False, "auto": "auto"}[
        cfg.cuda_graph], process_group=process_group)

    logger.info("optimizer: %s (%s)", cfg.name, routes.summary() if cfg.name == "muon" else
                f"adamw on all {sum(len(g['params']) for g in groups)} trainable tensors")
    adamw_params = decay + no_decay
    if adamw_params:
        if cfg.cautious:
            how = "speedtronic cautious_adamw_step_ op"
        elif cfg.fused is False or not fused_supported(adamw_params):
            how = "speedtronic foreach op (torch fused AdamW off)"
        else:
            how = "torch fused kernel"
        logger.info("adamw branch: %s", how)
    if cfg.name == "muon" and routes.muon:
        ns_dtype = cfg.muon_ns_dtype
        if ns_dtype == "auto":
            dev = routes.muon[0][1].device
            ns_dtype = "fp16 (auto, CUDA)" if dev.type == "cuda" else "fp32 (auto, no CUDA)"
        logger.info("muon branch: Newton-Schulz %s, %d steps, coefficients %s%s%s", ns_dtype,
                    cfg.muon_ns_steps, cfg.muon_coefficients, ", muon+" if cfg.muon_plus else "",
                    ", cautious" if cfg.cautious else "")
    return opt
