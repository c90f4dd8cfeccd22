"""User datasets (``data.dataset``): map-style or iterable, through a ``DataLoader``.

``data.dataset`` is ``"package.module:factory"`` (called with the whole config) or, from Python,
a live object. The factory/object may be a ``Dataset``, an ``IterableDataset``, a
``(train, eval)`` pair or ``{"train": ..., "eval": ...}``. Items are either a token sequence of
length ``T+1`` (shifted here, once) or an ``(input_ids, labels)`` pair / ``{"input_ids",
"labels"}`` dict that is already shifted (used as is).

Resume: map-style datasets are read in a seeded per-epoch permutation that this module owns, so
the position ``(epoch, batch)`` restores exactly. An ``IterableDataset`` cannot seek: resuming
re-reads and skips the consumed batches (logged), which is exact if the dataset is deterministic.
"""

from __future__ import annotations

import itertools
import logging
import math
import multiprocessing.util
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from ..config import ConfigError, SpeedtronicConfig
from ..errors import SpeedtronicError, check_factory_call, import_factory
from .sources import _u64
from .worker_signals import WorkerShield, start_forkserver_shielded

__all__ = ["collate_tokens", "resolve_user_dataset", "UserIterator", "user_eval_batches"]

logger = logging.getLogger("speedtronic.data")

Batch = tuple[torch.Tensor, torch.Tensor]


def _as_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))


def collate_tokens(items: Sequence[Any]) -> Batch:
    """Stack items into ``(input_ids, labels)``, each ``(B, T)`` int64, shifting raw sequences."""
    first = items[0]
    try:
        if isinstance(first, dict):
            x = torch.stack([_as_tensor(it["input_ids"]) for it in items])
            y = torch.stack([_as_tensor(it["labels"]) for it in items])
        elif isinstance(first, (tuple, list)) and len(first) == 2 and not isinstance(
                first[0], (int, np.integer)):
            x = torch.stack([_as_tensor(it[0]) for it in items])
            y = torch.stack([_as_tensor(it[1]) for it in items])
        else:
            seq = torch.stack([_as_tensor(it) for it in items])  # (B, T+1)
            x, y = seq[:, :-1], seq[:, 1:]  # the one shift
    except (KeyError, RuntimeError, TypeError, ValueError) as exc:
        raise SpeedtronicError(
            "data.dataset: items must be token sequences of equal length block_size+1, "
            "(input_ids, labels) pairs or {'input_ids', 'labels'} dicts of equal length; "
            f"could not batch them: {exc}") from exc
    if x.dim() != 2 or x.shape != y.shape:
        raise SpeedtronicError(f"data.dataset: a batch gave input_ids {tuple(x.shape)} and "
                               f"labels {tuple(y.shape)}; expected two equal (B, T) shapes")
    return x.to(torch.int64).contiguous(), y.to(torch.int64).contiguous()


def _stop_workers(loader: DataLoader) -> None:
    """Shut the persistent workers of ``loader`` down through its queue (they exit 0)."""
    it = getattr(loader, "_iterator", None)
    loader._iterator = None
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def _is_dataset(obj: Any) -> bool:
    return isinstance(obj, (Dataset, IterableDataset)) or (
        hasattr(obj, "__getitem__") and hasattr(obj, "__len__"))


def resolve_user_dataset(spec: Any, cfg: SpeedtronicConfig) -> tuple[Any, Any | None]:
    """``data.dataset`` -> ``(train_dataset, eval_dataset_or_None)``."""
    obj = spec
    if isinstance(spec, str):
        module_name, sep, attr = spec.partition(":")
        if not sep or not module_name or not attr:
            raise ConfigError(f"data.dataset: expected 'package.module:factory', got {spec!r}")
        factory = import_factory(spec, "data.dataset")
        check_factory_call(factory, "data.dataset", spec, "a Dataset, an IterableDataset, a "
                           "(train, eval) pair or a {'train': ..., 'eval': ...} dict")
        obj = factory(cfg)
    train, held = obj, None
    if isinstance(obj, dict):
        if "train" not in obj:
            raise ConfigError(f"data.dataset: a dict must have a 'train' key, got {sorted(obj)}")
        train, held = obj["train"], obj.get("eval")
    elif isinstance(obj, tuple) and len(obj) == 2 and all(map(_is_dataset, obj)):
        train, held = obj
    for which, ds in (("train", train), ("eval", held)):
        if ds is not None and not _is_dataset(ds):
            raise ConfigError(f"data.dataset: the {which} dataset is a {type(ds).__name__}, "
                              "expected a torch Dataset or IterableDataset")
    return train, held


class _IndexSampler(Sampler[int]):
    """Yields the index list it currently holds (set per epoch by :class:`UserIterator`)."""

    def __init__(self) -> None:
        self.indices: np.ndarray = np.zeros(0, dtype=np.int64)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices.tolist())

    def __len__(self) -> int:
        return len(self.indices)


class UserIterator:
    """Infinite, resumable micro-batch iterator over a user dataset."""

    def __init__(self, dataset: Any, batch_size: int, seed: int, rank: int, world: int,
                 shuffle: bool, num_workers: int, pin_memory: bool,
                 indices: np.ndarray | None = None) -> None:
        self.dataset = dataset
        self.B = batch_size
        self.seed = _u64(seed)
        self.rank, self.world = rank, world
        self.shuffle = shuffle
        self.iterable = isinstance(dataset, IterableDataset)
        self.indices = indices
        self.epoch = 0
        self.batch = 0  # batches consumed in this epoch (underlying batches for iterables)
        # Items consumed in this epoch (this rank's for a map-style dataset): the saved position,
        # so a resume with another micro_batch_size continues at the same item (in batches it
        # repeated or skipped B_new - B_old items per batch consumed)
        self.items = 0
        self._it: Iterator[Batch] | None = None
        self._sampler = None if self.iterable else _IndexSampler()
        if not self.iterable:
            if self.indices is None:
                self.indices = np.arange(len(dataset))
            per_rank = len(self.indices) // world
            if per_rank < batch_size:
                raise SpeedtronicError(
                    f"data.dataset: {len(self.indices)} training items give {per_rank} per rank "
                    f"on {world} rank(s), fewer than data.micro_batch_size={batch_size}")
        elif num_workers > 0:
            logger.info("data: IterableDataset with %d workers: each worker runs the dataset's "
                        "__iter__; shard inside it with torch.utils.data.get_worker_info()",
                        num_workers)
        # The loader's own generator: each iter() draws its workers' base seed from it, and
        # from torch's global RNG without one. A resume calls iter() where the uninterrupted
        # run did not, so the global RNG (dropout masks) moved: not bitwise with dropout 0.1.
        self._generator = torch.Generator()
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self._sampler,
                                 drop_last=True, num_workers=num_workers, pin_memory=pin_memory,
                                 collate_fn=collate_tokens, persistent_workers=num_workers > 0,
                                 generator=self._generator,
                                 worker_init_fn=WorkerShield() if num_workers > 0 else None)
        if num_workers > 0:
            # Workers stopped at interpreter exit before multiprocessing's own terminate-and-join
            # of daemon processes (finalizers of priority >= 0 run first, highest first; the
            # loader's queues close at 10): a worker ignores the first signal while its trainer
            # lives (worker_signals), so that join would wait for it.
            multiprocessing.util.Finalize(self, _stop_workers, args=(self.loader,),
                                          exitpriority=100)

    def _epoch_indices(self) -> np.ndarray:
        idx = self.indices
        if self.shuffle:
            idx = idx[np.random.default_rng([self.seed, self.epoch]).permutation(len(idx))]
        per_rank = len(idx) // self.world  # equal shares: ranks step in lock-step
        return idx[self.rank::self.world][:per_rank]

    def _start(self) -> None:
        if self.loader.num_workers > 0:
            start_forkserver_shielded()
        self._generator.manual_seed(int(np.random.default_rng([self.seed, self.epoch])
                                        .integers(2**63)))
        if self.iterable:
            self._it = iter(self.loader)
            skip = -(-self.items // self.B)  # whole batches covering the consumed items
            if self.items % self.B:
                logger.warning("data: the saved position (%d items into the IterableDataset) is "
                               "not a multiple of data.micro_batch_size=%d; resuming %d items "
                               "later", self.items, self.B, skip * self.B - self.items)
            self.batch, self.items = skip, skip * self.B
            if skip:
                logger.info("data: skipping %d batches of the IterableDataset to restore the "
                            "saved position", skip)
            for _ in range(skip):
                if next(self._it, None) is None:
                    raise SpeedtronicError("data.dataset: the IterableDataset is shorter than "
                                           "the saved position; was it changed?")
        else:
            self._sampler.indices = self._epoch_indices()[self.items:]
            self._it = iter(self.loader)

    def __iter__(self) -> UserIterator:
        return self

    def close(self) -> None:
        """Stop the DataLoader's worker processes now (the next batch starts new ones at the
        same position)."""
        self._it = None
        _stop_workers(self.loader)

    def __next__(self) -> Batch:
        empty_epochs = 0
        while True:
            if self._it is None:
                self._start()
            batch = next(self._it, None)
            if batch is None:  # end of epoch
                if self.batch == 0:
                    empty_epochs += 1
                    if empty_epochs > 1:
                        raise SpeedtronicError("data.dataset: the dataset yields no full "
                                               f"micro-batch of {self.B} items")
                self.epoch, self.batch, self.items, self._it = self.epoch + 1, 0, 0, None
                continue
            self.batch += 1
            self.items += self.B
            if self.iterable and (self.batch - 1) % self.world != self.rank:
                continue  # another rank's batch
            return batch

    def state_dict(self) -> dict[str, Any]:
        """The position after the last returned batch."""
        return {"kind": "user", "epoch": self.epoch, "batch": self.batch, "items": self.items}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the batch at which ``state`` was taken."""
        if state.get("kind") != "user":
            raise SpeedtronicError(f"data state is of kind {state.get('kind')!r}, expected "
                                   "'user' (was the checkpoint made with another data source?)")
        self.epoch, self.batch, self._it = int(state["epoch"]), int(state["batch"]), None
        # checkpoints before "items" counted batches of this run's size
        self.items = int(state.get("items", self.batch * self.B))


def holdout_split(n: int, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Map-style dataset without an eval set: hold out the last share of the indices.

    Independent of the batch size (eval batches cycle over a short eval set): trading micro-batch
    size for accumulation at the same target batch once changed which items were trained on."""
    k = min(max(1, math.ceil(n * eval_fraction)), n // 2)
    return np.arange(n - k), np.arange(n - k, n)


def user_eval_batches(dataset: Any, n: int, batch_size: int,
                      indices: np.ndarray | None = None) -> list[Batch]:
    """``n`` batches read in order (cycling over a map-style eval set if it is short)."""
    if isinstance(dataset, IterableDataset):
        items = list(itertools.islice(iter(dataset), n * batch_size))
        if len(items) < n * batch_size:
            items = list(itertools.islice(itertools.cycle(items), n * batch_size)) if items else []
    else:
        idx = indices if indices is not None else np.arange(len(dataset))
        if len(idx) == 0:
            items = []
        else:
            items = [dataset[int(idx[i % len(idx)])] for i in range(n * batch_size)]
    if not items:
        raise SpeedtronicError("data.dataset: the eval dataset is empty")
    return [collate_tokens(items[i * batch_size:(i + 1) * batch_size]) for i in range(n)]
