"""The scaling-out sections of the config (docs/scaling.md): ``distributed`` (asynchronous
DiLoCo over a store), ``data_parallel`` (torchrun DDP / FSDP2) and ``torchft`` (fault-tolerant
replica groups). Field docstrings are the reference documentation of each key.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlparse

from ..errors import ConfigError, brief
from .redaction import url_has_credentials
from .rules import INF_IS_NO_LIMIT, require

__all__ = ["DataParallelConfig", "DistributedConfig", "TorchftConfig", "check_store_url"]


def check_store_url(url: str, credentials: bool = False) -> None:
    """Raise :class:`ConfigError` unless ``url`` is a well-formed ``distributed.store`` URL.
    Syntax only, no I/O: ``validate`` once passed ``s3://``, ``hf://a/b/c`` or ``file://rel``
    that ``train`` then refused when it opened the store (which calls this too).
    ``credentials``: refuse a user or secret in the URL too (opening a store does; a config
    holding one still loads, so that it can be shown redacted and refused at the start)."""
    try:
        parsed = urlparse(url)
    except ValueError as exc:  # "Invalid IPv6 URL" for s3://[bad/p: it once named no key
        raise ConfigError(f"distributed.store: not a URL ({exc}): {brief(url)}") from None
    # urlparse ends the authority at the first '/', so "s3://KEY:SE/CRET@bucket" (AWS secrets
    # may hold '/') has no username for it: the regex looks before the path too
    if credentials and (parsed.username or parsed.password or url_has_credentials(url)):
        raise ConfigError("distributed.store: the URL must not carry credentials; set them in "
                          "the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, HF_TOKEN)")
    scheme = parsed.scheme or url.split("://", 1)[0]
    if scheme not in ("file", "s3", "hf"):
        raise ConfigError(f"distributed.store: must be file:///path, s3://bucket/prefix or "
                          f"hf://user/repo, got scheme {brief(scheme)}")
    if scheme == "file":
        # "file://" alone once stored into the current directory; "?..." and "#..." were
        # dropped without a word
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/") \
                or parsed.query or parsed.fragment:
            raise ConfigError(f"distributed.store: file URLs need an absolute path and nothing "
                              f"after it (file:///path), got {url!r}")
    elif parsed.query or parsed.fragment:  # "?revision=x" was dropped without a word
        raise ConfigError(f"distributed.store: {scheme} URLs take nothing after the path "
                          f"(no ?... or #...), got {url!r}")
    elif scheme == "s3" and not parsed.netloc:
        raise ConfigError(f"distributed.store: s3 URL needs a bucket: s3://bucket/prefix, "
                          f"got {url!r}")
    elif scheme == "hf" and f"{parsed.netloc}{parsed.path}".strip("/").count("/") != 1:
        raise ConfigError(f"distributed.store: hf URL must be hf://user/repo, got {url!r}")

@dataclass
class DistributedConfig:
    """DiLoCo-style asynchronous multi-node training over a shared store."""

    enabled: bool = False
    """Turn DiLoCo on."""
    role: Literal["master", "worker"] = "worker"
    """``master`` applies outer steps and publishes globals; ``worker`` trains and sends deltas."""
    node_id: str | None = None
    """This node's id (letters, digits, ``-_.``); None = hostname-pid."""
    store: str | None = None
    """Store URL: ``file:///path``, ``s3://bucket/prefix`` or ``hf://user/repo``. Credentials
    come only from the environment and are never written to disk."""
    inner_steps: int = 500
    """H: inner optimizer steps between deltas."""
    poll_interval: float = 60.0
    """Seconds between a worker's background polls of the global pointer (and the master's
    listings when ``master_poll_interval`` is null). Keep it under ~1/4 of a round: a worker
    warns when it is longer. About 1/20 of a round measured better still: a poll is one small
    GET, and a global is downloaded only once per new version (bench_diloco_async.md, M=4,
    outer 0.7/0.5: 1.028x -> 1.012x lock-step)."""
    master_poll_interval: float | None = None
    """Seconds between the master's listings of new deltas; null = ``poll_interval`` capped at
    1 s. The master should apply a delta within a small part of a round: in the simulated
    schedule (bench_diloco_async.md, M=3) listing once per round ended 6.3% above lock-step
    DiLoCo, every 1/20 of a round 3.3% (without carry_lookahead)."""
    grace_window: float = 0.0
    """Seconds the master waits after a listing finds new deltas, before aggregating, so that
    near-simultaneous arrivals land in one update (0 = apply at once)."""
    consistent_base: bool = True
    """At each round boundary install ``G - c * (own deltas G does not hold yet)``, with ``c``
    the total weight the master gives a delta (published in the pointer with each session's
    high-water mark), instead of a G missing this worker's own recent rounds
    (docs/diloco.md#consistent-base)."""
    carry_lookahead: float = 0.25
    """Carry ``c * (1 + carry_lookahead * (M - 1))`` instead of ``c``: the other workers' rounds
    in flight, which the global also lacks, extrapolated from this worker's own delta (workers'
    deltas point the same way). 0.25: each other worker is half a round into its own, and that
    work lands halfway through this worker's next round. 0 = the exact algebra. In the
    simulated schedule 0.25 beat 0 in every pair (bench_diloco_async.md: M=3 +1.6%/+0.3%
    above lock-step against +3.3%/+1.1%, M=4 +2.7% against +5.3%)."""
    rebase_within_round: bool = True
    """With ``consistent_base``: a newer global that arrives mid-round is absorbed at once
    (the weights move by new base - old base, the round's own progress kept) instead of at the
    next boundary, so the other workers' deltas reach this worker within a poll. One pass over
    the parameters per new global (about M per round). In the simulated schedule (M=4, 1200
    steps, bench_diloco_async.md) it took the mean over lock-step DiLoCo from 1.027 to 1.023
    with the master listing every 1/20 round, and from 1.052 to 1.034 listing once a round."""
    max_unapplied: int = 4
    """Most own deltas a worker keeps for its consistent base (each a host fp32 copy of the
    model). Beyond it, two deltas that both still wait for the store are sent as one; when the
    master is what lags, the worker waits up to ``unapplied_wait`` and then stops carrying the
    oldest, with a warning."""
    unapplied_wait: float = field(default=30.0, metadata=INF_IS_NO_LIMIT)
    """Seconds a worker waits at a boundary when ``max_unapplied`` deltas are outstanding."""
    adaptive_inner_steps: bool = False
    """Scale this worker's H by its measured speed: ``inner_steps * fastest / own`` seconds per
    step (the fastest recent worker's, published by the master), at least ``inner_steps / 8``,
    so a slow worker's rounds last as long as the others' and its deltas are not staler."""
    push_pull_timeout: float = 0.0
    """Push-pull: wait up to this many seconds at each boundary for a global that holds this
    worker's delta, and install it without carry (Liu et al. 2024); 0 = off. Off by default:
    it idles the worker while the master applies, and ended above the carry in the simulated
    schedule (bench_diloco_async.md, M=3: 1.404 against 1.393)."""
    outer_lr: float = 0.7
    """Outer learning rate."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum in [0, 1)."""
    outer_optimizer: Literal["eager_nesterov", "delayed_nesterov", "nesterov", "sgd"] = \
        "eager_nesterov"
    """Master update rule. ``eager_nesterov`` (default): each arriving delta's own Nesterov share
    ``lr (1 + eager_share * mu) / M`` applied at once, the rest of it, the old momentum's share
    and the refresh once per round of ``expected_workers`` deltas - ``nesterov`` when a round
    arrives together; with arrivals spread over the round it measured closer to lock-step than
    delayed Nesterov (M=4, 1200 steps, share 0.5: 1.011-1.019x against 1.022-1.023x;
    docs/diloco.md#outer-optimizer).
    ``delayed_nesterov`` (Liu et al. 2024): momentum-free steps as deltas arrive, the whole
    momentum step at the round's last arrival; the same round total.
    ``nesterov``: torch SGD-Nesterov on the mean of each poll's deltas (synchronous DiLoCo).
    ``sgd``: momentum-free, each delta weighted 1/M (outer_lr 1 = plain parameter averaging)."""
    eager_share: float = 0.5
    """``eager_nesterov`` only: the part of each delta's momentum share ``lr mu / M`` applied on
    arrival, the rest at the round's close (1: all of it; 0: delayed Nesterov; every value gives
    the same round total). 0.5: in the simulated schedule 1 had the best mean but one bad
    timing seed at M=3 (1.030x lock-step, a 3.3% spread), 0.5 kept every pair within 1.02x on
    the mean and 2% in spread (docs/diloco.md#outer-optimizer)."""
    expected_workers: int | None = None
    """Deltas per round (M) for delayed Nesterov, and how many finished nodes a master waits
    for before it stops; None = nodes that sent a delta recently / every node it has seen."""
    max_staleness: int = 8
    """Master drops (quarantines) deltas whose base is more than this many versions older than
    the version at which the master first listed them (time a delta waits in the master's own
    queue does not count)."""
    staleness_weighting: Literal["none", "inverse", "inverse_sqrt"] = "none"
    """Scale of a delta s versions stale: 1, 1/(1+s) or 1/sqrt(1+s)."""
    max_delta_norm: float | None = None
    """Master rejects deltas whose L2 norm exceeds this (None = no bound)."""
    min_deltas: int = 1
    """Master publishes only when at least this many valid deltas are waiting."""
    max_deltas_per_round: int = 16
    """Master applies at most this many deltas per published version (the rest wait for the
    next round): a backlog after an outage is worked off in bounded memory, one delta at a time
    in memory beside the running sum."""
    max_object_mb: float | None = None
    """Largest delta or global a node downloads; larger objects are quarantined unread. None =
    1.25x the model's fp32 size plus 1 MiB (what a legitimate object can be)."""
    compression: Literal["none", "bf16", "int8"] = "none"
    """Delta wire format: fp32, bf16 (2x smaller) or int8 with per-chunk scales (4x smaller);
    the quantization error is kept and sent with the next delta."""
    reset_inner_optimizer: bool = True
    """Reset the inner optimizer state after each confirmed delta upload."""
    start_timeout: float = field(default=600.0, metadata=INF_IS_NO_LIMIT)
    """Seconds a node waits at start for the first published global (``.inf`` = no limit)."""
    shutdown_timeout: float = field(default=120.0, metadata=INF_IS_NO_LIMIT)
    """Seconds a node waits at the end for its last deltas to upload (``.inf`` = no limit)."""
    final_sync_timeout: float = field(default=0.0, metadata=INF_IS_NO_LIMIT)
    """Seconds a worker waits at the end for a global containing its last delta and installs
    it (``.inf`` = no limit). 0, or no such global in time: with ``consistent_base`` the worker
    ends on the newest published global (its local weights stand on a carry-shifted base),
    without it on its local weights."""
    master_idle_timeout: float = field(default=600.0, metadata=INF_IS_NO_LIMIT)
    """A master node keeps aggregating after its own training until every node it has seen is
    done, or this many seconds pass without a new delta (``.inf`` = no limit, 0 = stop as soon
    as none is new; the standalone master counts from its start)."""
    lease_ttl: float = 300.0
    """Seconds without renewal after which a standby master takes the lease over."""
    keep_versions: int = 4
    """Published globals kept in the store (older ones and orphans are deleted)."""
    delete_processed: bool = True
    """Master deletes deltas once the version that consumed (or rejected) them is published."""
    shard: int = 0
    """This node's data shard: give every node its own so nodes train on disjoint samples."""
    num_shards: int = 1
    """Number of data shards (>= number of nodes for disjoint data)."""
    endpoint_url: str | None = None
    """S3 endpoint URL (MinIO, R2, HF buckets' S3 gateway) for an ``s3://`` store; None =
    the ``AWS_ENDPOINT_URL`` environment variable, else AWS itself."""

    def store_waits(self) -> dict[str, float]:
        """A worker's longest waits on the store, by the keys that bound them: at start, at the
        end, and at a round boundary (the push-pull wait for the master, then the bounded wait
        while ``max_unapplied`` deltas are unapplied). In a torchrun worker group the other
        ranks spend them in a collective, so ``data_parallel.timeout_s`` must exceed each."""
        return {"distributed.start_timeout": self.start_timeout,
                "final_sync_timeout + shutdown_timeout":
                    self.final_sync_timeout + self.shutdown_timeout,
                "push_pull_timeout + unapplied_wait":
                    self.push_pull_timeout + self.unapplied_wait}

    @property
    def master_poll(self) -> float:
        """The master's listing interval in seconds (``master_poll_interval`` or
        ``poll_interval``)."""
        if self.master_poll_interval is None:
            return min(self.poll_interval, 1.0)
        return self.master_poll_interval

    def check_node_id(self, p: str = "distributed") -> None:
        """``node_id``'s rule alone (run.name may be built from it before sections validate)."""
        if self.node_id is not None:
            require(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", self.node_id) is not None,
                    f"{p}.node_id", f"must be 1-64 of [A-Za-z0-9_.-] not starting with '.', "
                    f"got {brief(self.node_id)}")

    def validate(self, p: str = "distributed") -> None:
        """Check store URL (required when enabled), node id, intervals, timeouts and round limits;
        raise ConfigError naming the key."""
        if self.enabled:
            require(self.store is not None, f"{p}.store",
                   "is required when distributed.enabled is true (file:///..., s3://..., hf://...)")
        self.check_node_id(p)
        require(self.inner_steps > 0, f"{p}.inner_steps", f"must be > 0, got {self.inner_steps}")
        require(self.poll_interval > 0, f"{p}.poll_interval", "must be > 0")
        if self.master_poll_interval is not None:
            require(self.master_poll_interval > 0, f"{p}.master_poll_interval",
                   "must be > 0 or null")
        require(self.grace_window >= 0, f"{p}.grace_window", "must be >= 0")
        require(self.max_unapplied >= 1, f"{p}.max_unapplied", "must be >= 1")
        require(0 <= self.carry_lookahead <= 1, f"{p}.carry_lookahead", "must be in [0, 1]")
        require(0 <= self.eager_share <= 1, f"{p}.eager_share",
               f"must be in [0, 1], got {self.eager_share}")
        require(self.unapplied_wait >= 0, f"{p}.unapplied_wait", "must be >= 0")
        require(self.push_pull_timeout >= 0, f"{p}.push_pull_timeout", "must be >= 0")
        require(self.outer_lr > 0, f"{p}.outer_lr", f"must be > 0, got {self.outer_lr}")
        require(0.0 <= self.outer_momentum < 1.0, f"{p}.outer_momentum",
               f"must be in [0, 1), got {self.outer_momentum}")
        if self.expected_workers is not None:
            require(self.expected_workers > 0, f"{p}.expected_workers", "must be > 0 or null")
        require(self.max_staleness >= 0, f"{p}.max_staleness", "must be >= 0")
        if self.max_delta_norm is not None:
            require(self.max_delta_norm > 0, f"{p}.max_delta_norm", "must be > 0 or null")
        require(self.max_deltas_per_round >= max(1, self.min_deltas),
               f"{p}.max_deltas_per_round", f"must be >= 1 and >= min_deltas={self.min_deltas} "
               f"(a round could never publish), got {self.max_deltas_per_round}")
        if self.max_object_mb is not None:
            require(self.max_object_mb > 0, f"{p}.max_object_mb",
                   f"must be > 0, got {self.max_object_mb}")
        require(self.min_deltas >= 1, f"{p}.min_deltas", "must be >= 1")
        for key in ("start_timeout", "shutdown_timeout", "lease_ttl"):
            require(getattr(self, key) > 0, f"{p}.{key}", "must be > 0")
        for key in ("final_sync_timeout", "master_idle_timeout"):
            require(getattr(self, key) >= 0, f"{p}.{key}", "must be >= 0")
        require(self.lease_ttl > 2 * self.master_poll, f"{p}.lease_ttl",
               f"must exceed 2 x the master's poll interval={self.master_poll} (the master "
               f"renews once per poll), got {self.lease_ttl}")
        require(self.keep_versions >= 2, f"{p}.keep_versions", "must be >= 2 (nodes may still "
               "be downloading the previous version)")
        require(self.num_shards >= 1, f"{p}.num_shards",
               f"must be >= 1 (the number of data shards), got {self.num_shards}")
        require(0 <= self.shard < self.num_shards, f"{p}.shard",
               f"must be in [0, num_shards={self.num_shards}), got {self.shard}")
        if self.store is not None:
            check_store_url(self.store)
        if self.endpoint_url is not None:
            require(self.endpoint_url.split("://", 1)[0] in ("http", "https"), f"{p}.endpoint_url",
                   f"must be an http:// or https:// URL, got {brief(self.endpoint_url)}")
            require(self.store is None or self.store.startswith("s3://"), f"{p}.endpoint_url",
                   f"applies to s3:// stores only; distributed.store is "
                   f"{brief(self.store)} (remove endpoint_url)")


@dataclass
class DataParallelConfig:
    """``torchrun`` data parallelism (DDP): read only when the run is started by torchrun with
    more than one process; ``data.target_batch_size`` is then the global batch."""

    timeout_s: float | None = None
    """Seconds any collective may wait: a rank that died or hangs ends the job with an error
    after this long instead of a silent wait (torchrun itself stops the others when a rank
    exits with an error). null = 600, or, for a torchrun group that is one DiLoCo worker, 60 s
    more than rank 0's longest wait for the store (``distributed.start_timeout``,
    ``final_sync_timeout + shutdown_timeout``, or ``push_pull_timeout + unapplied_wait`` at a
    round boundary), which the other ranks spend in a collective (at the defaults 600 = 600 was
    refused, so the documented command failed)."""
    shard_muon: bool = True
    """Each rank orthogonalizes 1/world of the Muon matrices and all-gathers the results
    (bitwise equal to every rank doing all of them). Newton-Schulz FLOPs per rank drop to
    1/world; the all-gather adds (world-1)/world of the Muon parameters' bytes on top of DDP's
    gradient all-reduce."""
    zero1: bool = False
    """ZeRO stage 1 (torch's ``ZeroRedundancyOptimizer``): each rank keeps the optimizer state
    of about 1/world of the parameters, steps only those (its Newton-Schulz too, so
    ``shard_muon`` is implied) and broadcasts them after the step. Saves ~(world-1)/world of
    the optimizer state (Muon: 4 bytes per matrix element, AdamW: 8 per element) per rank and
    costs one parameter broadcast per step, about half of DDP's all-reduce traffic again:
    for a model whose state does not fit, not for speed. Checkpoints keep the plain format
    (a run resumes with it on or off). speedtronic/distributed/zero.py has the details."""
    reduce_scatter_muon: bool = False
    """Each Muon matrix gets one owning rank: its gradients are reduce-scattered to the owner
    (they leave DDP's all-reduce), which alone keeps its momentum and steps it, and the updated
    matrices are all-gathered. The step sends DDP's all-reduce bytes (not 1.17x, as
    ``shard_muon``), every Muon pass (not only Newton-Schulz) runs on 1/world of the matrices,
    Muon momentum per rank drops to ~1/world, for one extra fp32 buffer of the Muon
    parameters. Supersedes ``shard_muon``; not combined with ``zero1``, ``fsdp``, fp16,
    ``optimizer.cuda_graph`` or torchft. speedtronic/distributed/
    muon_owners.py has the details."""
    find_unused_parameters: bool = False
    """DDP's search for parameters a forward did not use (costs a graph walk per step; turn on
    only for models with such parameters: DDP then says so in its error)."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB (torch's default): larger buckets mean fewer all-reduce
    launches, smaller ones start the communication earlier in backward."""
    fsdp: bool = False
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) instead of DDP: every transformer block
    is one unit, the root another. Parameters, gradients and optimizer state are sharded, ~1/world
    of each per rank; costs one all-gather of each unit's parameters in forward and again in
    backward, and a reduce-scatter of its gradients (DDP: one all-reduce). Muon all-gathers each
    matrix's fp32 blend for Newton-Schulz and splits that work over the ranks itself, so
    ``shard_muon`` does not apply. Checkpoints keep the plain one-process format. Not combined
    with ``zero1``, ``optimizer.cuda_graph``, ``ooo_backprop``, torchft, hierarchical DiLoCo,
    ``compile: true`` or fp16 (docs/scaling.md#fsdp2)."""

    def resolve_timeout(self, diloco: DistributedConfig) -> None:
        """Fill a null ``timeout_s`` (see the field)."""
        if self.timeout_s is not None:
            return
        longest = max(diloco.store_waits().values())
        self.timeout_s = 600.0
        if diloco.enabled and math.isfinite(longest):  # .inf: the start check asks for a value
            self.timeout_s = max(600.0, longest + 60.0)

    def validate(self, p: str = "data_parallel") -> None:
        """Check ``timeout_s`` (set by :meth:`resolve_timeout` first) and ``bucket_cap_mb``; raise
        ConfigError naming the key."""
        require(self.timeout_s is not None and self.timeout_s > 0, f"{p}.timeout_s",
                f"must be > 0 seconds, got {self.timeout_s}")
        require(self.bucket_cap_mb > 0, f"{p}.bucket_cap_mb",
               f"must be > 0 MiB, got {self.bucket_cap_mb}")


@dataclass
class TorchftConfig:
    """Fault-tolerant replica groups on torchft (``pip install 'speedtronic[ft]'``): each group
    is one ``speedtronic train`` process or one torchrun job (DDP inside the group); a torchft
    Lighthouse admits the groups alive at each step (``ddp``) or round (``diloco``), a group
    that dies is dropped and one that (re)starts is healed from a live peer over HTTP.
    docs/scaling.md#torchft has the commands."""

    mode: Literal["off", "ddp", "diloco"] = "off"
    """``ddp``: gradients averaged over the live groups every step, a step committed only when
    every group in the quorum finished it. ``diloco``: synchronous DiLoCo, ``inner_steps``
    local steps, then the groups' pseudo-gradients are averaged for one outer Nesterov step."""
    lighthouse: str | None = None
    """The Lighthouse's address, e.g. ``http://10.0.0.1:29510``; null = ``$TORCHFT_LIGHTHOUSE``."""
    replica_group: int | None = None
    """This group's id, 0..replica_groups-1 (its data shard and run sub-directory); null =
    ``$REPLICA_GROUP_ID``."""
    replica_groups: int = 2
    """Groups the job is started with: the number of data shards, and the bound for
    ``min_replica_size``."""
    min_replica_size: int = 1
    """Fewest groups that may commit a step. A group alone with fewer live peers never commits
    (torchft raises nothing): here it stops after ``max_commit_failures`` with an error."""
    max_commit_failures: int = 50
    """Consecutive steps that may fail to commit before the run ends with an error."""
    timeout_s: float = 60.0
    """Seconds a gradient all-reduce, a commit vote or a healing transfer may take; also how
    long a Lighthouse that cannot be reached at all is retried (measured: 68 s at 60)."""
    quorum_timeout_s: float = 300.0
    """Seconds a group waits for a quorum (the Lighthouse's ``--min_replicas`` groups) from a
    Lighthouse that answers; one that cannot be reached is bounded by ``timeout_s``."""
    manager_port: int = 0
    """Port of this group's torchft Manager server (0 = any free port). It listens on every
    interface (torchft binds ``[::]``); the healing HTTP server does too."""
    hostname: str | None = None
    """Address the other groups reach this one at (its Manager and healing server); null = this
    machine's host name. Tests use 127.0.0.1."""
    inner_steps: int = 100
    """``diloco``: local optimizer steps between outer steps."""
    outer_lr: float = 0.7
    """``diloco``: the outer Nesterov-SGD learning rate (DiLoCo's 0.7)."""
    outer_momentum: float = 0.9
    """``diloco``: the outer Nesterov momentum."""

    def validate(self, p: str = "torchft") -> None:
        """With ``mode`` on: check replica groups, lighthouse, timeouts and outer settings; raise
        ConfigError naming the key."""
        if self.mode == "off":
            return
        require(self.replica_groups >= 1, f"{p}.replica_groups",
               f"must be >= 1, got {self.replica_groups}")
        require(1 <= self.min_replica_size <= self.replica_groups, f"{p}.min_replica_size",
               f"must be in 1..replica_groups={self.replica_groups}, got "
               f"{self.min_replica_size}: with fewer groups than that alive no step can ever "
               "commit")
        require(self.replica_group is not None, f"{p}.replica_group",
               "is required with torchft.mode on (or set REPLICA_GROUP_ID), e.g. 0 for the "
               "first group")
        assert self.replica_group is not None
        require(0 <= self.replica_group < self.replica_groups, f"{p}.replica_group",
               f"must be in [0, replica_groups={self.replica_groups}), got "
               f"{self.replica_group}")
        require(self.lighthouse is not None, f"{p}.lighthouse",
               "is required with torchft.mode on (or set TORCHFT_LIGHTHOUSE), e.g. "
               "http://127.0.0.1:29510 (start it with: torchft_lighthouse --min_replicas 1 "
               "--bind [::]:29510)")
        require(self.max_commit_failures >= 1, f"{p}.max_commit_failures", "must be >= 1")
        for key in ("timeout_s", "quorum_timeout_s", "outer_lr"):
            require(getattr(self, key) > 0, f"{p}.{key}", "must be > 0")
        require(0 <= self.manager_port < 65536, f"{p}.manager_port", "must be in 0..65535")
        require(self.inner_steps >= 1, f"{p}.inner_steps", "must be >= 1")
        require(0.0 <= self.outer_momentum < 1.0, f"{p}.outer_momentum", "must be in [0, 1)")
