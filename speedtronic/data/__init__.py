"""Data: ``build_data(cfg, rank=, world=) -> DataBundle`` with a resumable train iterator.

* :mod:`.build` - picks the configured source and wraps it (``build_data``, ``DataBundle``);
* :mod:`.checks` - the token files a config names open and fit the vocabulary (no torch);
* :mod:`.sources` - token stores: the stdlib corpus, a UTF-8 text file, synthetic ids;
* :mod:`.token_files` - pre-tokenized ``.bin`` / ``.npy`` shards, memory-mapped;
* :mod:`.prepare` - a tokenizer over text files or a Hugging Face dataset, into cached shards
  (its text in :mod:`.prepare_sources`, its worker pool and shard writer in :mod:`.prepare_shards`);
* :mod:`.sampler` - shuffled, sharded, exactly resumable windows over a token store;
* :mod:`.user` - a user's ``Dataset`` / ``IterableDataset`` from ``data.dataset``.
"""

from __future__ import annotations

from typing import Any

from .checks import check_data

# The builder imports torch: loaded on first use (PEP 562), so `speedtronic validate` can read
# token files through `speedtronic.data.checks` without it.
_LAZY = {"BYTE_VOCAB": "build", "TEXT_CHUNK_BYTES": "build", "DataBundle": "build",
         "TrainIterator": "build", "build_data": "build", "collate_tokens": "user"}

__all__ = ["BYTE_VOCAB", "DataBundle", "TEXT_CHUNK_BYTES", "TrainIterator", "build_data",
           "check_data", "collate_tokens"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'speedtronic.data' has no attribute {name!r}")
