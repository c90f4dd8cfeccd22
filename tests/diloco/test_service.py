"""End to end through ``speedtronic train``: a master node that also trains plus one worker,
each a real process configured only by a YAML ``distributed`` section."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from harness import applied_keys, child_env  # noqa: E402

from speedtronic.diloco import codec  # noqa: E402
from speedtronic.diloco.store import open_store  # noqa: E402

pytestmark = pytest.mark.slow


def _config(tmp: Path, name: str, role: str, shard: int) -> Path:
    cfg = {
        "run": {"name": name, "output_dir": str(tmp / "runs"), "seed": 7, "max_steps": 20,
                "eval_every": 0, "eval_batches": 1, "device": "cpu"},
        "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "max_seq_len": 16},
        "data": {"synthetic": True, "num_tokens": 20000, "micro_batch_size": 4},
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "scheduler": {"warmup_steps": 2},
        "checkpoint": {"enabled": False},
        "logging": {"every_steps": 5, "progress_bar": False},
        "distributed": {"enabled": True, "role": role, "node_id": name,
                        "store": f"file://{tmp}/store", "inner_steps": 5, "poll_interval": 0.05,
                        "lease_ttl": 2.0, "shard": shard, "num_shards": 2,
                        "final_sync_timeout": 60, "master_idle_timeout": 60,
                        "keep_versions": 1000, "expected_workers": 2},  # keep the chain to audit it
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_speedtronic_train_master_and_worker(tmp_path):
    procs = []
    for name, role, shard in (("master", "master", 0), ("w1", "worker", 1)):
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append((name, log, subprocess.Popen(
            [sys.executable, "-m", "speedtronic", "train", "--config",
             str(_config(tmp_path, name, role, shard))],
            env=child_env(), stdout=log, stderr=subprocess.STDOUT)))
    try:
        for name, _, p in procs:
            rc = p.wait(timeout=180)
            assert rc == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for _, log, p in procs:
            if p.poll() is None:
                p.kill()
            log.close()
    store = open_store(f"file://{tmp_path}/store")
    applied = applied_keys(store)
    sent = {k for k in store.list("nodes/") if codec.parse_delta_key(k)}
    assert len(applied) == len(set(applied)) and sent == set()  # processed ones are deleted
    assert {k.split("/")[1] for k in applied} == {"master", "w1"}
    total_sent = 0
    for name in ("master", "w1"):
        rows = [json.loads(line) for line in
                (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        dl = [r for r in rows if "diloco/deltas_sent" in r]
        assert dl and dl[-1]["diloco/deltas_sent"] >= 4 and dl[-1]["diloco/version"] >= 1
        assert 0 <= dl[-1]["diloco/train_thread_frac"] < 0.5
        total_sent += dl[-1]["diloco/deltas_sent"]
    assert total_sent == len(applied)  # every delta either node sent was applied once


def test_the_standalone_master_reads_the_idle_timeout_as_a_training_master_does(tmp_path,
                                                                               capsys):
    """0 stops as soon as no delta is new (it once meant "no limit" here, the opposite of a
    training master's 0); a negative value is refused. At the end it names the final global
    (it once said only its version)."""
    from speedtronic.diloco.__main__ import main

    cfg = str(_config(tmp_path, "m", "master", 0))
    assert main(["master", "--config", cfg, "--idle-timeout", "-5"]) == 2
    assert main(["master", "--config", cfg, "--idle-timeout", "0",
                 "--set", "distributed.expected_workers=null"]) == 0  # returns, no worker came
    published = list((tmp_path / "store").glob("global/v*"))
    assert len(published) == 1  # it published v0, then stopped
    said = capsys.readouterr().out
    assert f"master done at v0: the final global is global/{published[0].name}" in said
