"""speedtronic 2.0's checkpoints (``<output_dir>/checkpoints/step_<12 digits>.pt`` beside
``latest.json``, pickles without digests): every way of pointing this version at one names it
and leaves the 2.0 files as they were, and ``model.init_from`` loads its weights under this
version's names. ``--resume`` once started a fresh run without naming them (it looks one folder
deeper) and ``model.init_from`` asked for a digest 2.0 never wrote."""

from __future__ import annotations

import collections
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from _engine_fixtures import one_thread, tiny_raw  # noqa: F401

from speedtronic.cli import main
from speedtronic.config import ConfigError, load_config
from speedtronic.train.checkpoint import CheckpointError, CheckpointManager
from speedtronic.train.run_model import run_checkpoint
from speedtronic.train.v2_checkpoints import find_v2_checkpoints

#: A 2.0 model section (its smoke config's shape, smaller): 2.0 built its SwiGLU
#: int(2/3 * 48) = 32 wide, rounded up to a multiple of n_head: d_ff 32 here.
V2_MODEL = {"name": "reference_transformer", "vocab_size": 64, "max_seq_len": 32, "n_layer": 2,
            "n_head": 4, "n_kv_head": 2, "d_model": 32, "d_ff": 48, "dropout": 0.0,
            "tie_weights": True, "rope_base": 10000.0, "gradient_checkpointing": False}
HERE = {k: V2_MODEL[k] for k in ("vocab_size", "max_seq_len", "n_layer", "n_head", "n_kv_head",
                                 "d_model")}
_TO_V2 = (("embed.", "transformer.wte."), ("final_norm.", "transformer.ln_f."),
          ("blocks.", "transformer.h."), (".attn_norm.", ".ln1."), (".mlp_norm.", ".ln2."),
          (".attn.o_proj.", ".attn.out_proj."))


def _v2_run(output_dir: Path) -> dict[str, str]:
    """2.0's layout and file: a pickle of its model (2.0's tensor names), optimizer, config and
    numpy RNG state (numpy arrays: 2.0 wrote them); returns every file's sha256."""
    from speedtronic.models import build_model

    torch.manual_seed(5)
    model = build_model(load_config({"model": {**HERE, "d_ff": 32}}).model)
    state_v2 = collections.OrderedDict()
    for name, tensor in model.state_dict().items():
        for new, old in _TO_V2:
            name = name.replace(new, old)
        state_v2[name] = tensor
    folder = output_dir / "checkpoints"
    folder.mkdir(parents=True)
    state = {"model": state_v2, "optimizer": {}, "scaler": None, "step": 4,
             "config": {"run": {"name": "smoke"}, "model": V2_MODEL}, "coordinator": None,
             "rng": {"numpy": np.random.RandomState(0).get_state()}}
    for step in (2, 4):
        torch.save(state, folder / f"step_{step:012d}.pt")
    (folder / "latest.json").write_text(json.dumps({"step": 4, "file": "step_000000000004.pt"}))
    return _digests(output_dir)


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_resume_of_a_2_0_run_names_its_checkpoints_and_starts_fresh(tmp_path, capsys):
    """A job that always passes --resume starts fresh when there is nothing of this version to
    resume (the documented rule); beside a 2.0 run the warning now says why."""
    out = tmp_path / "runs"
    before = _v2_run(out)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw(out, name="smoke", run={"max_steps": 2})))
    assert main(["train", "--config", str(cfg), "--resume"]) == 0
    printed = capsys.readouterr()
    (line,) = [ln for ln in (printed.out + printed.err).splitlines()
               if "starting a fresh run" in ln]
    assert f"{out / 'checkpoints'} holds speedtronic 2.0 checkpoints" in line
    after = _digests(out)
    assert {k: after[k] for k in before} == before  # the 2.0 files untouched
    assert (out / "smoke" / "checkpoints").is_dir()


def test_resume_where_2_0_checkpoints_fill_this_runs_folder_stops_with_exit_2(tmp_path, capsys):
    out = tmp_path / "runs"
    before = _v2_run(out / "smoke")  # run.output_dir of 2.0 was this run's directory
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw(out, name="smoke")))
    assert main(["train", "--config", str(cfg), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "holds speedtronic 2.0 checkpoints" in err and "Traceback" not in err
    assert _digests(out / "smoke") == before


def test_a_fresh_run_moving_a_2_0_run_aside_does_not_suggest_resuming_it(tmp_path, capsys):
    out = tmp_path / "runs"
    before = _v2_run(out / "smoke")  # 2.0's output_dir is this run's directory
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw(out, name="smoke", run={"max_steps": 1})))
    assert main(["train", "--config", str(cfg)]) == 0
    printed = capsys.readouterr()
    (line,) = [ln for ln in (printed.out + printed.err).splitlines() if "held an earlier" in ln]
    assert "speedtronic 2.0 checkpoints" in line and "--resume" not in line
    (aside,) = out.glob("smoke.old-*")
    assert _digests(aside) == before


def test_a_2_0_checkpoint_file_or_folder_is_named_as_such(tmp_path):
    before = _v2_run(tmp_path)
    ckpt = tmp_path / "checkpoints" / "step_000000000004.pt"
    with pytest.raises(CheckpointError, match="is a speedtronic 2.0 checkpoint: .*init_from"):
        CheckpointManager(ckpt.parent).load(ckpt, verify=False)
    with pytest.raises(ConfigError, match="holds speedtronic 2.0 checkpoints"):
        run_checkpoint(tmp_path)  # sample / export of a 2.0 run folder
    assert _digests(tmp_path) == before


@pytest.mark.parametrize("point_at", ["file", "run folder"])
def test_init_from_loads_a_2_0_checkpoints_weights_under_the_new_names(tmp_path, point_at):
    from speedtronic.models import build_model
    from speedtronic.train.run_model import init_from

    before = _v2_run(tmp_path / "v2")
    source = (tmp_path / "v2" / "checkpoints" / "step_000000000004.pt" if point_at == "file"
              else tmp_path / "v2")
    cfg = load_config(tiny_raw(tmp_path / "new", model={**HERE, "d_ff": 32,
                                                        "init_from": str(source)}))
    model = build_model(cfg.model)
    assert "speedtronic 2.0 checkpoint" in init_from(model, cfg)
    torch.manual_seed(5)  # the model _v2_run saved
    expected = build_model(load_config({"model": {**HERE, "d_ff": 32}}).model).state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert _digests(tmp_path / "v2") == before


def test_init_from_a_2_0_checkpoint_names_the_d_ff_to_set_and_refuses_other_objects(tmp_path):
    from speedtronic.models import build_model
    from speedtronic.train.run_model import init_from

    _v2_run(tmp_path / "v2")
    cfg = load_config(tiny_raw(tmp_path / "new", model={**HERE, "d_ff": 48,
                                                        "init_from": str(tmp_path / "v2")}))
    # 2.0's d_ff: 48 built a 32-wide MLP; here d_ff is the width itself
    with pytest.raises(ConfigError, match="model.d_ff is 48 here but 32 in the 2.0 checkpoint"):
        init_from(build_model(cfg.model), cfg)
    odd = tmp_path / "odd" / "checkpoints"
    odd.mkdir(parents=True)
    torch.save({"model": {}, "extra": Path("x")}, odd / "step_000000000001.pt")
    cfg = load_config(tiny_raw(tmp_path / "new2", model={**HERE, "d_ff": 32,
                                                         "init_from": str(tmp_path / "odd")}))
    with pytest.raises(ConfigError, match="refused unopened"):
        init_from(build_model(cfg.model), cfg)


def test_this_versions_own_checkpoints_are_not_taken_for_2_0_ones(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save(4, {"model": {"w": torch.zeros(2)}, "step": 4})
    assert find_v2_checkpoints(tmp_path) is None
    assert manager.load_latest()[0]["step"] == 4
    # a 12-digit name that carries this version's digest is ours (a run past 10^8 steps)
    big = manager.save(123_456_789_012, {"model": {"w": torch.zeros(2)}, "step": 1})
    assert find_v2_checkpoints(tmp_path) is None and manager.load(big)["step"] == 1


def test_2_0_checkpoints_with_any_numpy_array_or_numpy_1_names_load(tmp_path):
    """2.0 pickled numpy's RNG state: arrays of any dtype, and numpy 1.x's module names
    (numpy.core.multiarray), were a raw UnpicklingError traceback."""
    import zipfile

    from speedtronic.train.v2_checkpoints import load_v2_weights

    weights = {"transformer.wte.weight": torch.ones(4, 2)}
    arrays = {d: np.zeros(3, dtype=d) for d in ("f2", "i1", "u2", "c8", "M8[s]", "U3")}
    path = tmp_path / "step_000000000001.pt"
    torch.save({"model": weights, "config": {"model": {}}, "rng": arrays}, path)
    tensors, _ = load_v2_weights(path)
    assert torch.equal(tensors["embed.weight"], torch.ones(4, 2))
    # the same file as numpy 1.x wrote it: its array builder under numpy.core
    old = tmp_path / "old" / "step_000000000001.pt"
    old.parent.mkdir()
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(old, "w", zipfile.ZIP_STORED) as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("data.pkl"):
                assert b"numpy._core.multiarray" in data
                data = data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
            dst.writestr(item, data)
    tensors, _ = load_v2_weights(old)
    assert torch.equal(tensors["embed.weight"], torch.ones(4, 2))
