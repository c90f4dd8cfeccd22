"""torchft replica groups (``torchft.mode: ddp | diloco``) on CPU over gloo, on loopback.

Each process test starts a Lighthouse in this process and 1-2 ``speedtronic train`` groups
(~3-6 s each on the 2-core CI machine): two groups agree bitwise under ddp and under DiLoCo, a
killed group is survived and a restarted one heals to its peer's step and ends bitwise equal,
and a group that can never commit stops with an error instead of looping silently. The config
rules run without torchft."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from speedtronic.config import ConfigError, load_config

from .test_torchrun import _final_weights, _rows  # metrics rows, the last checkpoint's weights

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def _raw(tmp: Path, name: str, group: int, **over: dict) -> dict:
    raw = {
        "run": {"name": name, "output_dir": str(tmp / "runs"), "max_steps": 12,
                "eval_every": 6, "eval_batches": 2, "seed": 3, "device": "cpu",
                "num_threads": 1},
        "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "max_seq_len": 32},
        "data": {"micro_batch_size": 4, "target_batch_size": 8, "stdlib_max_bytes": 200_000},
        "optimizer": {"name": "muon", "grad_clip": 1.0},
        "scheduler": {"warmup_steps": 2},
        "logging": {"every_steps": 2, "progress_bar": False},
        "checkpoint": {"every_steps": 4},
        "shape_validation": {"enabled": False},
        "torchft": {"mode": "ddp", "replica_group": group, "replica_groups": 2,
                    "hostname": "127.0.0.1", "timeout_s": 20, "quorum_timeout_s": 60},
    }
    for sec, values in over.items():
        raw.setdefault(sec, {}).update(values)
    return raw


def _write(tmp: Path, raw: dict) -> Path:
    path = tmp / f"{raw['run']['name']}-{raw['torchft'].get('replica_group', 'env')}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _run_dir(tmp: Path, name: str, group: int) -> Path:
    return tmp / "runs" / name / f"replica_group_{group}"


# ---- config rules (no torchft needed) -------------------------------------------------------
def test_min_replica_size_above_the_groups_is_refused_with_the_key(tmp_path):
    raw = _raw(tmp_path, "cfg", 0, torchft={"min_replica_size": 3, "lighthouse": "http://h:1"})
    with pytest.raises(ConfigError, match=r"torchft\.min_replica_size.*1\.\.replica_groups=2"):
        load_config(_write(tmp_path, raw))


def test_group_and_lighthouse_come_from_torchft_env_vars(tmp_path, monkeypatch):
    raw = _raw(tmp_path, "cfg", 0)
    raw["torchft"].pop("replica_group")
    path = _write(tmp_path, raw)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    with pytest.raises(ConfigError, match=r"torchft\.replica_group.*REPLICA_GROUP_ID"):
        load_config(path)
    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    with pytest.raises(ConfigError, match=r"torchft\.lighthouse.*torchft_lighthouse"):
        load_config(path)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://10.0.0.1:29510")
    cfg = load_config(path)
    assert (cfg.torchft.replica_group, cfg.torchft.lighthouse) == (1, "http://10.0.0.1:29510")
    assert cfg.run_dir == tmp_path / "runs" / "cfg" / "replica_group_1"  # groups never share


@pytest.mark.parametrize("over, message", [
    ({"distributed": {"enabled": True, "store": "file:///tmp/x"}}, "pick one"),
    ({"ooo_backprop": True}, "ooo_backprop: false"),
])
def test_combinations_that_cannot_work_are_refused(tmp_path, over, message):
    from speedtronic.distributed.torchft_groups import check_supported

    raw = _raw(tmp_path, "cfg", 0, torchft={"lighthouse": "http://h:1"})
    for key, value in over.items():
        if isinstance(value, dict):
            raw.setdefault(key, {}).update(value)
        else:
            raw[key] = value
    cfg = load_config(_write(tmp_path, raw))
    with pytest.raises(ConfigError, match=message):
        check_supported(cfg)


@pytest.mark.parametrize("over, message", [
    ({"zero1": True}, "zero1.*healing peer"),
    ({"reduce_scatter_muon": True}, "reduce_scatter_muon.*whole gradient")])
def test_what_a_torchrun_replica_group_cannot_shard_is_refused(tmp_path, monkeypatch, over,
                                                               message):
    from speedtronic.distributed.torchft_groups import check_supported

    cfg = load_config(_write(tmp_path, _raw(tmp_path, "cfg", 0, data_parallel=over,
                                            torchft={"lighthouse": "http://h:1"})))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=message):
        check_supported(cfg)


# ---- processes on loopback -------------------------------------------------------------------
# the Lighthouse in this process would log every quorum at INFO
os.environ.setdefault("RUST_LOG", "warn")
torchft = pytest.importorskip("torchft", reason="torchft is not installed: pip install "
                              "'speedtronic[ft]' (CI installs it with the dev extra)")


class Lighthouse:
    """A torchft Lighthouse on 127.0.0.1 (a free port) in the test process."""

    def __init__(self, min_replicas: int = 1, heartbeat_timeout_ms: int = 1000) -> None:
        from torchft._torchft import LighthouseServer

        self.server = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas,
                                       join_timeout_ms=20_000,
                                       heartbeat_timeout_ms=heartbeat_timeout_ms)
        port = self.server.address().rsplit(":", 1)[1]
        self.address = f"http://127.0.0.1:{port}"  # it advertises the host name

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def lighthouse():
    lh = Lighthouse()
    yield lh
    lh.close()


def _env(lh: Lighthouse) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               TORCHFT_LIGHTHOUSE=lh.address, RUST_LOG="warn")
    env.pop("WORLD_SIZE", None)
    env.pop("REPLICA_GROUP_ID", None)
    return env


def _start(args: list[str], lh: Lighthouse) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(lh), cwd=ROOT)


def _train(cfg: Path, lh: Lighthouse) -> subprocess.Popen:
    return _start(["-m", "speedtronic", "train", "--config", str(cfg)], lh)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.parametrize("mode", ["ddp", "diloco"])
def test_two_groups_end_bitwise_equal_on_different_shards(tmp_path, mode):
    # evals at the DiLoCo round ends (steps 4, 8, 12), where the groups hold one global
    over = {"torchft": {"mode": mode, "inner_steps": 4}, "run": {"eval_every": 4}}
    lighthouse = Lighthouse(min_replicas=2)  # both start together: no healing in this test
    try:
        procs = [_train(_write(tmp_path, _raw(tmp_path, mode, g, **over)), lighthouse)
                 for g in (0, 1)]
        for proc in procs:
            _finish(proc)
    finally:
        lighthouse.close()
    dirs = [_run_dir(tmp_path, mode, g) for g in (0, 1)]
    w0, w1 = (_final_weights(d) for d in dirs)
    assert w0.keys() == w1.keys()
    for key in w0:
        assert torch.equal(w0[key], w1[key]), key
    # each group trained on its own shard: their training losses differ, the model is one
    losses = [[r["loss"] for r in _rows(d, "train_step")] for d in dirs]
    assert losses[0] != losses[1]
    evals = [[r["eval_loss"] for r in _rows(d, "eval")] for d in dirs]
    assert len(evals[0]) == 4 and evals[0] == evals[1] and evals[0][-1] < evals[0][0]


@pytest.mark.parametrize("mode", ["ddp", "diloco"])
def test_a_killed_group_is_survived_and_a_restarted_one_heals(tmp_path, lighthouse, mode):
    name = f"heal-{mode}"
    # diloco: rounds of 4 steps; the groups hold one model only at round ends (32, not 30)
    over = {"run": {"max_steps": 30 if mode == "ddp" else 32},
            "torchft": {"mode": mode, "inner_steps": 4}}
    cfgs = [_write(tmp_path, _raw(tmp_path, name, g, **over)) for g in (0, 1)]
    gate, up = tmp_path / "restarted", tmp_path / "doomed-up"
    job = str(HERE / "ft_job.py")
    reached = tmp_path / "survivor-at-20"
    survivor = _start([job, str(cfgs[0]), "--wait-start", str(up), "--wait-at", "20",
                       "--gate", str(gate), "--reached", str(reached)], lighthouse)
    doomed = _start([job, str(cfgs[1]), "--announce", str(up), "--die-at", "6"], lighthouse)
    out, _ = doomed.communicate(timeout=240)
    assert doomed.returncode == -9, out[-3000:]  # SIGKILL after step 6: no cleanup at all
    # Restart only once the survivor holds at step 20: a restart that came up while a loaded
    # survivor was still near step 6 healed there (seen once in CI).
    deadline = time.monotonic() + 240
    while not reached.exists() and survivor.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # polls a condition the survivor sets, not a timed pause
    assert reached.exists(), "the survivor never reached step 20"
    restarted = _start([job, str(cfgs[1]), "--resume", "--announce", str(gate)], lighthouse)
    _finish(survivor)
    out1 = _finish(restarted)
    g0, g1 = _run_dir(tmp_path, name, 0), _run_dir(tmp_path, name, 1)
    assert [r["step"] for r in _rows(g0, "train_step")][-1] == over["run"]["max_steps"]
    # the restarted group resumed its last checkpoint, then healed from the survivor when
    # they met in a quorum: ddp at one of the survivor's steps after 20, diloco at one of its
    # round ends after 20 (which one depends on when the restart joins: the Lighthouse does
    # not wait for it). `step` is the steps done before the healing one.
    heals = _rows(g1, "torchft_heal")
    assert heals, out1[-3000:]
    healed_at = heals[-1]["step"]
    assert healed_at >= 20 and (mode == "ddp" or healed_at % 4 == 3), healed_at
    resumed = _rows(g1, "train_start")[-1]["step"]
    assert resumed in (4, 8)  # its checkpoints: every 4 steps, killed after step 6
    w0, w1 = _final_weights(g0), _final_weights(g1)
    for key in w0:
        assert torch.equal(w0[key], w1[key]), key
    # the healed group's counters follow the step it healed to (they once kept its own)
    assert _rows(g1, "train_end")[-1]["tokens"] == _rows(g0, "train_end")[-1]["tokens"]
    # the survivor trained alone after group 1 died (the Lighthouse dropped it when its
    # heartbeat stopped), and with both again from the healing: under ddp from the step after
    # it (the healing step counts only the groups already there: the quorum is asynchronous),
    # under diloco from the healing round itself (a synchronous quorum heals first)
    quorum = [(r["step"], r["participants"]) for r in _rows(g0, "torchft_quorum")]
    together = healed_at + (2 if mode == "ddp" else 1)
    assert quorum[-2][1] == 1 and quorum[-1] == (together, 2), (quorum, healed_at)


def test_healing_state_counts_from_the_start_of_the_step_whatever_thread_sends_it():
    """Under ddp the asynchronous quorum sends the healing state from torchft's thread while
    the trainer counts the step's micro-batches: a healed group once ended 128 tokens (one
    micro-batch) short of its peer. The peer sends its counters as the step began, and the
    healed group adds its own micro-batches of that step, as the peer will."""
    from types import SimpleNamespace

    from speedtronic.distributed.torchft_groups import ReplicaGroups

    def trainer(step: int, tokens: int, samples: int) -> SimpleNamespace:
        model = torch.nn.Linear(2, 2)
        t = SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            scheduler=None, scaler=None, step=step, tokens=tokens,
                            samples=samples, metrics=SimpleNamespace(emit=lambda *a: None))

        def jump_to_step(step: int, tokens: int | None, samples: int | None) -> None:
            t.step, t.tokens, t.samples = step, tokens, samples

        t.jump_to_step = jump_to_step
        return t

    def groups(t: SimpleNamespace) -> ReplicaGroups:
        g = object.__new__(ReplicaGroups)
        g.mode, g.trainer, g.group, g.heals, g._at_begin = "ddp", t, 1, 0, None
        g.manager = SimpleNamespace(start_quorum=lambda: None)
        return g

    peer, healer = groups(trainer(20, 20 * 256, 20 * 8)), groups(trainer(8, 8 * 256, 8 * 8))
    for g in (peer, healer):
        g.begin_step()
        g.trainer.tokens, g.trainer.samples = g.trainer.tokens + 128, g.trainer.samples + 4
    sent = peer._peer_state()  # torchft's thread, the peer one micro-batch of two into step 21
    assert (sent["step"], sent["tokens"], sent["samples"]) == (20, 20 * 256, 20 * 8)
    healer.trainer.tokens, healer.trainer.samples = healer.trainer.tokens + 128, \
        healer.trainer.samples + 4  # the healer's second micro-batch
    healer._load_peer_state(sent)
    peer.trainer.tokens, peer.trainer.samples = peer.trainer.tokens + 128, \
        peer.trainer.samples + 4  # the peer's second micro-batch
    for g in (peer, healer):
        assert (g.trainer.step, g.trainer.tokens, g.trainer.samples) == (20, 21 * 256, 21 * 8)
    # outside a step's quorum (or where begin_step never ran) the live counters are sent
    assert groups(trainer(3, 30, 3))._peer_state()["tokens"] == 30


def test_a_group_that_can_never_commit_stops_with_an_error(tmp_path, lighthouse):
    raw = _raw(tmp_path, "alone", 0, torchft={"min_replica_size": 2, "max_commit_failures": 3})
    proc = _train(_write(tmp_path, raw), lighthouse)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode != 0
    assert "3 steps in a row did not commit" in out and "min_replica_size is 2" in out, out
    assert "Traceback" not in out


def test_an_unreachable_lighthouse_is_a_clear_error(tmp_path):
    raw = _raw(tmp_path, "nolh", 0, torchft={"lighthouse": "http://127.0.0.1:9",
                                             "timeout_s": 2})
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), RUST_LOG="warn")
    env.pop("TORCHFT_LIGHTHOUSE", None)
    proc = subprocess.run([sys.executable, "-m", "speedtronic", "train", "--config",
                           str(_write(tmp_path, raw))], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Lighthouse at http://127.0.0.1:9" in out and "Traceback" not in out, out[-3000:]


@pytest.mark.parametrize("mode", ["ddp", "diloco"])
def test_a_quorum_that_never_forms_is_a_clear_error_in_both_modes(tmp_path, mode):
    # The Lighthouse waits for 2 groups and only one comes: the quorum times out, inside the
    # step (ddp) or inside optimizer.step()'s DiLoCo hook (diloco); either way the user reads
    # what to check, not torchft's raw timeout.
    lh = Lighthouse(min_replicas=2)
    try:
        raw = _raw(tmp_path, f"noquorum-{mode}", 0,
                   torchft={"mode": mode, "inner_steps": 2, "quorum_timeout_s": 3,
                            "timeout_s": 5})
        proc = _train(_write(tmp_path, raw), lh)
        out, _ = proc.communicate(timeout=180)
    finally:
        lh.close()
    assert proc.returncode != 0, out[-3000:]
    assert "torchft: no quorum for" in out and "Traceback" not in out, out[-3000:]
    assert ("DiLoCo round" in out) == (mode == "diloco"), out[-3000:]


def _torchrun(args: list[str], lh: Lighthouse) -> subprocess.Popen:
    """A replica group of 2 torchrun ranks running ``args`` (a script or ``-m module``)."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node=2", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(lh), cwd=ROOT)


def _every_rank(tmp: Path, dirs: tuple[str, ...]) -> list[dict[str, torch.Tensor]]:
    """Final weights ft_job.py --save-weights wrote for each rank of each group."""
    return [torch.load(tmp / d / f"rank{r}.pt", weights_only=True) for d in dirs
            for r in (0, 1)]


def _two_torchrun_groups(tmp: Path, name: str, over: dict) -> None:
    """Groups 0 and 1 of `name`, 2 torchrun ranks each, started together to the end; every
    rank's final weights in tmp/w<group>/rank<r>.pt."""
    lighthouse = Lighthouse(min_replicas=2)
    try:
        procs = [_torchrun([str(HERE / "ft_job.py"),
                            str(_write(tmp, _raw(tmp, name, g, **over))),
                            "--save-weights", str(tmp / f"w{g}")], lighthouse)
                 for g in (0, 1)]
        for proc in procs:
            _finish(proc)
    finally:
        lighthouse.close()


def test_replica_groups_of_two_torchrun_ranks_train_what_four_ddp_ranks_train(tmp_path):
    """Two groups of 2 torchrun ranks each (DDP inside a group, torchft across, each rank
    averaging its half of the gradient with its peer rank): the groups end bitwise equal, on
    the weights of one 4-rank DDP job over the same samples (group g's rank r reads shard
    g + 2 r of 4, what DDP's rank g + 2 r reads)."""
    steps = {"run": {"max_steps": 6, "eval_every": 3}, "checkpoint": {"every_steps": 3}}
    _two_torchrun_groups(tmp_path, "hsdp", steps)
    ref = _raw(tmp_path, "ddp4", 0, data={"target_batch_size": 16}, **steps)
    ref["torchft"] = {"mode": "off"}
    ref_path = tmp_path / "ddp4.yaml"
    ref_path.write_text(yaml.safe_dump(ref))
    plain = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node=4", "-m", "speedtronic", "train", "--config",
                            str(ref_path)], capture_output=True, text=True, cwd=ROOT,
                           env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
                           timeout=300)
    assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-2000:]
    w0 = _final_weights(_run_dir(tmp_path, "hsdp", 0))
    ranks = _every_rank(tmp_path, ("w0", "w1"))
    expected = _final_weights(tmp_path / "runs" / "ddp4")
    for key in w0:
        assert all(torch.equal(w[key], w0[key]) for w in ranks), key  # 4 ranks, 2 groups
        torch.testing.assert_close(w0[key], expected[key], rtol=0, atol=2e-5, msg=key)
    assert [r["loss"] for r in _rows(_run_dir(tmp_path, "hsdp", 0), "train_step")] != \
        [r["loss"] for r in _rows(_run_dir(tmp_path, "hsdp", 1), "train_step")]


def test_a_killed_torchrun_group_is_survived_and_its_restart_heals_rank_by_rank(
        tmp_path, lighthouse):
    """Groups of 2 torchrun ranks under ddp: both ranks of group 1 die (SIGKILL) after step 6,
    torchrun ends that group, group 0 trains on alone; group 1 restarted from its checkpoint
    heals each rank from the same rank of group 0 and ends bitwise equal to it."""
    over = {"run": {"max_steps": 24}}
    cfgs = [_write(tmp_path, _raw(tmp_path, "heal-group", g, **over)) for g in (0, 1)]
    gate, up = tmp_path / "restarted", tmp_path / "doomed-up"
    job = str(HERE / "ft_job.py")
    survivor = _torchrun([job, str(cfgs[0]), "--wait-start", str(up), "--wait-at", "16",
                          "--gate", str(gate), "--save-weights", str(tmp_path / "w0")],
                         lighthouse)
    doomed = _torchrun([job, str(cfgs[1]), "--announce", str(up), "--die-at", "6"],
                       lighthouse)
    out, _ = doomed.communicate(timeout=240)
    assert doomed.returncode != 0, out[-3000:]  # torchrun reports its killed ranks
    restarted = _torchrun([job, str(cfgs[1]), "--resume", "--announce", str(gate),
                           "--save-weights", str(tmp_path / "w1")], lighthouse)
    _finish(survivor)
    out1 = _finish(restarted)
    g0, g1 = _run_dir(tmp_path, "heal-group", 0), _run_dir(tmp_path, "heal-group", 1)
    assert [r["step"] for r in _rows(g0, "train_step")][-1] == 24
    heals = _rows(g1, "torchft_heal")  # rank 0's record (the other rank writes no metrics)
    assert heals and heals[-1]["step"] >= 16, out1[-3000:]
    assert _rows(g1, "train_start")[-1]["step"] == 4  # its last checkpoint before the kill
    w0 = _final_weights(g0)
    for key in w0:  # every rank of both groups: each rank healed from its peer rank
        assert all(torch.equal(w[key], w0[key]) for w in _every_rank(tmp_path, ("w0", "w1"))), key


def test_torchrun_groups_under_torchft_diloco_end_on_one_global(tmp_path):
    """torchft.mode: diloco with groups of 2 torchrun ranks: inner steps under DDP inside each
    group, the outer step on torchft's group rank by rank; after the last round all 4 ranks
    hold one model, and it learned."""
    over = {"run": {"max_steps": 8, "eval_every": 4},
            "torchft": {"mode": "diloco", "inner_steps": 4}}
    _two_torchrun_groups(tmp_path, "hdiloco", over)
    ranks = _every_rank(tmp_path, ("w0", "w1"))
    for key in ranks[0]:
        assert all(torch.equal(w[key], ranks[0][key]) for w in ranks), key
    evals = [r["eval_loss"] for r in _rows(_run_dir(tmp_path, "hdiloco", 0), "eval")]
    assert evals == [r["eval_loss"] for r in _rows(_run_dir(tmp_path, "hdiloco", 1), "eval")]
    assert len(evals) == 3 and evals[-1] < evals[0]
