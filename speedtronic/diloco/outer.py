"""The master's outer optimizer: how arrived pseudo-gradients move the global weights.

Four methods (``distributed.outer_optimizer``):

``nesterov``
    The DiLoCo paper's outer step on the (staleness-weighted) mean of the deltas that arrived:
    ``buf = mu * buf + g; theta -= lr * (g + mu * buf)``, exactly ``torch.optim.SGD(nesterov=True)``
    with the pseudo-gradient as ``.grad``. Right for a synchronous schedule (every worker's delta
    arrives in the same poll). With uneven workers it applies momentum to small stale arrivals
    and trailed delayed Nesterov in our uneven-worker ladder (benchmarks/results/bench_diloco.md).
``delayed_nesterov``
    Delayed Nesterov (Liu et al. 2024, "Asynchronous Local-SGD"): each update takes a
    momentum-free step ``lr * g`` with ``g = sum(w_i * d_i) / M`` (M = workers per round), adds
    ``g`` to an accumulator, and once M deltas have arrived refreshes the momentum with the
    accumulated round: ``buf = mu * buf + acc; theta -= lr * (g + mu * buf)``. When all M deltas
    of a round arrive together this *is* the Nesterov step above, so the synchronous case loses
    nothing; when they trickle in, momentum moves once per round instead of once per arrival.
``eager_nesterov`` (default)
    Delayed Nesterov with the arriving delta's own Nesterov share applied at once: each update
    steps ``lr * (1 + mu) * g`` and adds ``g`` to the accumulator; the M-th arrival applies the
    old momentum's share ``lr * mu^2 * buf`` and refreshes ``buf = mu * buf + acc``. With
    ``buf_new = mu * buf + acc`` the Nesterov step ``lr * (acc + mu * buf_new)`` is
    ``lr * ((1 + mu) * acc + mu^2 * buf)``: the two methods apply the same total per round (and
    are the same step when a round arrives together); delayed Nesterov holds the ``lr * mu * g``
    part of every delta back until the round's last arrival, up to a round late. Why: with
    arrivals spread over the round (workers out of phase) that held-back part is progress the
    global - and so every worker's base - lacks; applying it on arrival took asynchronous
    DiLoCo from 1.023x to 1.011x lock-step (M=4, 1200 steps, bench_diloco_async.md).
    ``distributed.eager_share`` s in [0, 1] applies ``lr * (1 + s * mu) * g`` on arrival and
    the rest, ``lr * mu * (1 - s) * acc``, at the round's close: 1 is the above, 0 is delayed
    Nesterov, and every s applies the same round total. The default 0.5 (the config's and this
    class's) measured best at M=3/4 (docs/diloco.md).
``sgd``
    ``theta -= lr * g`` with ``g = sum(w_i * d_i) / M`` as in delayed Nesterov, so ``lr=1`` is
    plain parameter averaging (LocalSGD) whether a round's deltas arrive in one poll or one per
    poll (dividing by the poll's own count applied each lone arrival in full: the sum of the
    workers' deltas, not their mean).

Staleness ``s = current_version - base_version`` scales a delta by ``w(s)``
(``distributed.staleness_weighting``: ``none`` = 1, ``inverse`` = 1/(1+s), ``inverse_sqrt``).
All state is fp32 on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

METHODS = ("nesterov", "delayed_nesterov", "eager_nesterov", "sgd")
ROUND_METHODS = ("delayed_nesterov", "eager_nesterov")  # momentum refreshed once per round of M
WEIGHTINGS = ("none", "inverse", "inverse_sqrt")


def carry_weight(method: str, lr: float, momentum: float, workers: float) -> float:
    """The total weight one arriving delta ends up with in the global, ``c``.

    Delayed Nesterov moves the global by ``lr * d / M`` on arrival and adds ``d / M`` to the
    round's accumulator; every later momentum refresh applies it again scaled by ``lr * mu^k``:
    ``lr/M * (1 + mu + mu^2 + ...) = lr / (M (1 - mu))``. Nesterov on a full round is the same
    step, and so is eager Nesterov (``lr (1 + mu) / M`` on arrival, ``lr mu^(k+1) / M`` at the
    k-th refresh after it); ``sgd`` (and momentum 0) stops at ``lr / M``. A worker that installs
    ``G - c * (its deltas G does not hold yet)`` starts its next round from what G will be once
    the master has applied them, instead of a base missing its own last round (the lag that made
    asynchronous DiLoCo lose to one node, docs/diloco.md#consistent-base)."""
    m = max(float(workers), 1.0)
    if method == "sgd" or momentum == 0.0:
        return lr / m
    return lr / (m * (1.0 - momentum))


def staleness_weight(staleness: int, policy: str) -> float:
    """Scale of a delta ``staleness`` versions stale (``distributed.staleness_weighting``): 1
    (``none``), 1/(1+s) (``inverse``) or 1/sqrt(1+s) (``inverse_sqrt``); else ValueError."""
    if policy == "none":
        return 1.0
    if policy == "inverse":
        return 1.0 / (1.0 + staleness)
    if policy == "inverse_sqrt":
        return 1.0 / math.sqrt(1.0 + staleness)
    raise ValueError(f"unknown staleness_weighting {policy!r}; valid: {', '.join(WEIGHTINGS)}")


class OuterOptimizer:
    """Applies weighted pseudo-gradients to a dict of fp32 CPU tensors in place."""

    def __init__(self, method: str = "eager_nesterov", lr: float = 0.7,
                 momentum: float = 0.9, eager_share: float = 0.5) -> None:
        if method not in METHODS:
            raise ValueError(f"unknown outer_optimizer {method!r}; valid: {', '.join(METHODS)}")
        if not 0.0 <= eager_share <= 1.0:
            raise ValueError(f"eager_share must be in [0, 1], got {eager_share}")
        self.method, self.lr, self.momentum = method, lr, momentum
        # eager Nesterov: the part of each delta's momentum share lr*mu*d/M applied on arrival
        # (1: all of it; 0: none, which is delayed Nesterov)
        self.eager_share = eager_share
        self.buf: dict[str, torch.Tensor] = {}
        self.acc: dict[str, torch.Tensor] = {}
        self.arrived = 0.0  # eager/delayed Nesterov: deltas counted towards the current round
        # The method and share the round in progress started with. A restart with another
        # round method or share finishes that round as it began (its arrivals already applied
        # their part; closing it with the new share would misapply lr*mu*(s_new - s_old)*acc),
        # then switches at the next round.
        self.round_method, self.round_share = method, eager_share

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor],
             deltas: Sequence[tuple[dict[str, torch.Tensor], float]], workers: float = 1.0) -> None:
        """One outer update from ``deltas`` = [(delta, weight), ...]; ``workers`` = M."""
        if not deltas:
            return
        total = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in params.items()}
        for delta, w in deltas:
            for key, acc in total.items():
                acc.add_(delta[key].float(), alpha=w)
        self.step_sum(params, total, sum(w for _, w in deltas), len(deltas), workers)

    def step_sum(self, params: dict[str, torch.Tensor], weighted_sum: dict[str, torch.Tensor],
                 total_weight: float, count: int, workers: float = 1.0) -> None:
        """The same update from ``sum(w_i * delta_i)`` over ``count`` deltas: the master adds
        deltas into it one at a time, so a round holds one decoded delta beside the sum
        whatever the backlog. ``weighted_sum`` is consumed (scaled in place)."""
        if count <= 0:
            return
        rounds = self.method in ROUND_METHODS
        if rounds or self.method == "sgd":
            denom = max(float(workers), 1.0)
        else:
            denom = total_weight if total_weight > 0 else 1.0
        for key, theta in params.items():
            g = weighted_sum[key].div_(denom)  # (same shape as theta), fp32
            self._apply(key, theta, g, count, workers)
        if rounds:
            self.arrived += count
            if self.arrived >= workers:  # the round closed inside _apply: start the next one
                self.arrived = math.fmod(self.arrived, max(float(workers), 1.0))
                self.acc.clear()
                self.round_method, self.round_share = self.method, self.eager_share

    def _apply(self, key: str, theta: torch.Tensor, g: torch.Tensor, n: int,
               workers: float) -> None:
        mu, lr = self.momentum, self.lr
        if self.method == "sgd" or mu == 0.0:
            theta.sub_(g.to(theta.dtype), alpha=lr)
            return
        if self.method == "nesterov":
            buf = self.buf.get(key)
            if buf is None:
                buf = self.buf[key] = g.clone()  # torch.optim.SGD: first step buf = g
            else:
                buf.mul_(mu).add_(g)
            theta.sub_((g + mu * buf).to(theta.dtype), alpha=lr)
            return
        acc = self.acc.get(key)
        if acc is None:
            acc = self.acc[key] = torch.zeros_like(g)
        acc.add_(g)
        if self.round_method == "eager_nesterov":
            share = self.round_share
            theta.sub_(g.to(theta.dtype), alpha=lr * (1.0 + share * mu))  # this arrival's share
            if self.arrived + n >= workers:  # the round closes: the rest and the old momentum's
                if share < 1.0:
                    theta.sub_(acc.to(theta.dtype), alpha=lr * mu * (1.0 - share))
                buf = self.buf.get(key)
                if buf is None:
                    self.buf[key] = acc.clone()
                else:
                    theta.sub_(buf.to(theta.dtype), alpha=lr * mu * mu)
                    buf.mul_(mu).add_(acc)
            return
        # delayed Nesterov
        if self.arrived + n >= workers:  # this update completes a round: refresh momentum
            buf = self.buf.get(key)
            if buf is None:
                buf = self.buf[key] = acc.clone()
            else:
                buf.mul_(mu).add_(acc)
            theta.sub_((g + mu * buf).to(theta.dtype), alpha=lr)
        else:
            theta.sub_(g.to(theta.dtype), alpha=lr)

    # ------------------------------------------------------------------ persistence
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Momentum buffers (``buf/<name>``) and round accumulators (``acc/<name>``), saved in
        the master state published with each global; the scalars are in :meth:`state_meta`."""
        out = {f"buf/{k}": v for k, v in self.buf.items()}
        out.update({f"acc/{k}": v for k, v in self.acc.items()})
        return out

    def state_meta(self) -> dict:
        """The JSON-safe settings and round progress that go with :meth:`state_tensors`."""
        return {"method": self.method, "lr": self.lr, "momentum": self.momentum,
                "eager_share": self.eager_share, "arrived": self.arrived,
                "round_method": self.round_method, "round_share": self.round_share}

    def load(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore saved state. The momentum is kept across any change of method (it means
        the same in all three momentum methods). A round in progress under delayed or eager
        Nesterov is finished as it began when the configured method is one of the two (a
        restart from the old default, delayed, to eager loses nothing); switching to
        ``nesterov`` or ``sgd`` mid-round drops that round's held-back momentum share."""
        self.buf = {k[4:]: v.float().clone() for k, v in tensors.items() if k.startswith("buf/")}
        self.acc = {k[4:]: v.float().clone() for k, v in tensors.items() if k.startswith("acc/")}
        self.arrived = float(meta.get("arrived", 0.0))
        saved_method = str(meta.get("round_method", meta.get("method", self.method)))
        # States saved before the share was recorded ran the configured share.
        saved_share = float(meta.get("round_share", meta.get("eager_share", self.eager_share)))
        self.round_method, self.round_share = self.method, self.eager_share
        if self.method not in ROUND_METHODS or saved_method not in ROUND_METHODS:
            if saved_method != self.method:
                self.acc.clear()
                self.arrived = 0.0
        elif self.arrived > 0.0:
            self.round_method, self.round_share = saved_method, saved_share
