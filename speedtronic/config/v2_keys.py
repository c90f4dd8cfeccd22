"""Config keys and values of speedtronic 2.0 that this version does not have, with what to
write instead.

An unknown key gets the closest valid key as a hint, which for a 2.0 key was often wrong and
sometimes harmful: ``distributed.repo_id`` suggested ``distributed.node_id`` (the repo is a
``store`` URL now), ``data.max_steps`` suggested ``data.stdlib_max_bytes``. The loader consults
:data:`V2_REMOVED_KEYS` first and names the 2.0 key's replacement, or why it is gone.
docs/configuration.md lists the same keys (a test keeps the two in step).
"""

from __future__ import annotations

__all__ = ["V2_REMOVED_KEYS", "V2_REMOVED_VALUES", "v2_key_advice", "v2_value_advice"]

V2_REMOVED_KEYS: dict[str, str] = {
    "run.log_every": "set logging.every_steps (or the root log_every)",
    "data.vocab_size": "set model.vocab_size; data takes the model's (or the tokenizer's)",
    "data.max_steps": "set run.max_steps (2.0's data.max_steps silently overrode it)",
    "data.prefetch_factor": "remove it: token windows are read in ~1 MiB chunks in the "
                            "training process, and a data.dataset loader uses torch's default",
    "data.drop_last": "remove it: every micro-batch is full (token windows never leave a "
                      "partial batch; a data.dataset loader drops the last partial one)",
    "precision.dtype": "remove it: precision.mode (auto, fp32, bf16, fp16) says everything",
    "logging.json_file": "remove it: every run writes metrics.jsonl in its run directory; "
                         "logging.file keeps the console log",
    "distributed.mode": "remove it: DiLoCo over a store is distributed.enabled: true with a "
                        "distributed.role; torchrun and torchft are data_parallel and torchft",
    "distributed.collaborators": "remove it: workers are whoever can write to "
                                 "distributed.store",
    "distributed.repo_id": "set distributed.store: hf://owner/name, the repo_id as a URL "
                           "(file:// and s3:// work too)",
    "distributed.token": "remove it: credentials come from the environment (HF_TOKEN; "
                         "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), never from a file",
    "distributed.cache_dir": "remove it: the store's objects are not cached on disk",
    "distributed.state_dir": "remove it: a node's state is in its run directory's checkpoints",
    "distributed.retry_initial": "remove it: store calls retry with a fixed jittered backoff "
                                 "(6 attempts, 0.5 s doubling to 30 s)",
    "distributed.retry_max": "remove it: store calls retry with a fixed jittered backoff "
                             "(6 attempts, 0.5 s doubling to 30 s)",
    "distributed.retry_attempts": "remove it: store calls retry with a fixed jittered backoff "
                                  "(6 attempts, 0.5 s doubling to 30 s)",
    "distributed.async_delta_upload": "remove it: deltas always upload in the background",
    "distributed.delta_upload_queue_size": "remove it: distributed.max_unapplied bounds the "
                                           "deltas a worker holds",
    "distributed.delta_upload_overflow": "remove it: a worker over distributed.max_unapplied "
                                         "waits up to distributed.unapplied_wait, never drops "
                                         "a delta",
    "distributed.delta_upload_shutdown_timeout": "set distributed.shutdown_timeout",
    "distributed.async_global_poll": "remove it: the global model is always polled in the "
                                     "background (distributed.poll_interval)",
}
"""``section.key`` of 2.0 -> what to write instead (an instruction, without a final period)."""

V2_REMOVED_VALUES: dict[tuple[str, str], str] = {
    ("distributed.role", "single"): "2.0's 'single' meant not distributed: remove "
                                    "distributed.role (distributed.enabled is false by default)",
}
"""``(section.key, value)`` of 2.0 that this version refuses -> what to write instead."""


def v2_key_advice(dotted: str) -> str | None:
    """The error for an unknown key that 2.0 had, or None for any other key."""
    advice = V2_REMOVED_KEYS.get(dotted)
    if advice is None:
        return None
    return f"'{dotted}' is a speedtronic 2.0 key this version does not have; {advice}"


def v2_value_advice(dotted: str, value: object) -> str | None:
    """The error for a 2.0 value this version refuses, or None."""
    if not isinstance(value, str):
        return None
    advice = V2_REMOVED_VALUES.get((dotted, value))
    return None if advice is None else f"{dotted}: {value!r} is a speedtronic 2.0 value; {advice}"
