"""Data: ``build_data(cfg, rank=, world=) -> DataBundle`` with a resumable train iterator.

* :mod:`.build` - picks the configured source and wraps it (``build_data``, ``DataBundle``);
* :mod:`.sources` - token stores: the stdlib corpus, a UTF-8 text file, synthetic ids;
* :mod:`.token_files` - pre-tokenized ``.bin`` / ``.npy`` shards, memory-mapped;
* :mod:`.prepare` - a tokenizer over text files or a Hugging Face dataset, into cached shards;
* :mod:`.sampler` - shuffled, sharded, exactly resumable windows over a token store;
* :mod:`.user` - a user's ``Dataset`` / ``IterableDataset`` from ``data.dataset``.
"""

from __future__ import annotations

from .build import (
    BYTE_VOCAB,
    TEXT_CHUNK_BYTES,
    DataBundle,
    TrainIterator,
    build_data,
    check_data,
)
from .user import collate_tokens

__all__ = ["BYTE_VOCAB", "DataBundle", "TEXT_CHUNK_BYTES", "TrainIterator", "build_data",
           "check_data", "collate_tokens"]
