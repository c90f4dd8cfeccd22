"""Config loading: shorthands, strict types, unknown-key suggestions, overrides, redaction."""

from __future__ import annotations

import json

import pytest
import yaml

from speedtronic.config import ConfigError, SpeedtronicConfig, load_config


def test_defaults_fill_cross_section_values():
    cfg = load_config({"run": {"seed": 7, "max_steps": 42}, "model": {"max_seq_len": 64}})
    assert cfg.data.block_size == 64
    assert cfg.data.seed == 7
    assert cfg.scheduler.max_steps == 42
    assert cfg.data.target_batch_size == cfg.data.micro_batch_size
    assert cfg.accumulation_steps == 1


def test_explicit_scheduler_horizon_is_kept_even_if_it_equals_1000():
    # The reference engine overwrote an explicit 1000 with run.max_steps.
    cfg = load_config({"max_steps": 50, "scheduler": {"max_steps": 1000}})
    assert cfg.scheduler.max_steps == 1000


def test_shorthands_expand():
    cfg = load_config({"optimizer": "muon", "muon_plus": True, "cautious": True,
                       "precision": "bf16", "name": "x", "seed": 3, "max_steps": 9,
                       "output_dir": "out", "compile": {"enabled": True}, "log_every": 5})
    assert cfg.optimizer.name == "muon" and cfg.optimizer.muon_plus and cfg.optimizer.cautious
    assert cfg.precision.mode == "bf16"
    assert (cfg.run.name, cfg.run.seed, cfg.run.max_steps, cfg.run.output_dir) == ("x", 3, 9, "out")
    assert cfg.compile is True
    assert cfg.logging.every_steps == 5


@pytest.mark.parametrize("raw, fragment", [
    ({"name": "a", "run": {"name": "b"}}, "run.name"),
    ({"cautious": True, "optimizer": {"cautious": False}}, "optimizer.cautious"),
])
def test_conflicting_shorthands_are_errors(raw, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(raw)


def test_same_value_in_both_places_is_fine():
    assert load_config({"seed": 5, "run": {"seed": 5}}).run.seed == 5


@pytest.mark.parametrize("raw, expected", [
    ({"optimzer": {}}, "did you mean 'optimizer'"),
    ({"optimizer": {"muon_lrr": 0.1}}, "'optimizer.muon_lrr'; did you mean 'optimizer.muon_lr'"),
    ({"model": {"n_layers": 2}}, "did you mean 'model.n_layer'"),
])
def test_unknown_keys_name_full_path_and_suggest(raw, expected):
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    assert expected in str(info.value)


@pytest.mark.parametrize("raw, key", [
    ({"compile": "false"}, "compile"),
    ({"ooo_backprop": "false"}, "ooo_backprop"),
    ({"run": {"max_steps": "10"}}, "run.max_steps"),
    ({"run": {"max_steps": 1.5}}, "run.max_steps"),
    ({"run": {"max_steps": True}}, "run.max_steps"),
    ({"optimizer": {"betas": [0.9]}}, "optimizer.betas"),
    ({"optimizer": {"name": "sgd"}}, "optimizer.name"),
    ({"model": "big"}, "model"),
])
def test_wrong_types_are_errors(raw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(raw)


@pytest.mark.parametrize("raw, key", [
    ({"optimizer": {"lr": 0}}, "optimizer.lr"),
    ({"optimizer": {"betas": [0.9, 1.0]}}, "optimizer.betas"),
    ({"ooo_streams": 9}, "ooo_streams"),
    ({"model": {"n_head": 3, "d_model": 64}}, "model.d_model"),
    ({"model": {"n_kv_head": 3}}, "model.n_kv_head"),
    ({"data": {"micro_batch_size": 4, "target_batch_size": 6}}, "data.target_batch_size"),
    ({"data": {"text_path": "/no/such/file.txt"}}, "data.text_path"),
    ({"data": {"synthetic": True, "text_path": __file__}}, "data"),
    ({"optimizer": {"muon_plus": True}}, "optimizer.muon_plus"),
    ({"optimizer": {"name": "muon", "muon_coefficients": [1.0, 2.0]}},
     "optimizer.muon_coefficients"),
    ({"distributed": {"enabled": True}}, "distributed.store"),
    ({"distributed": {"node_id": "../evil"}}, "distributed.node_id"),
    ({"run": {"name": "a/b"}}, "run.name"),
    ({"scheduler": {"min_lr_ratio": 2}}, "scheduler.min_lr_ratio"),
])
def test_out_of_range_values_are_errors(raw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(raw)


def test_int_widens_to_float_and_literals_are_case_insensitive():
    cfg = load_config({"optimizer": {"lr": 1, "name": "MUON"}, "precision": "BF16"})
    assert isinstance(cfg.optimizer.lr, float) and cfg.optimizer.name == "muon"
    assert cfg.precision.mode == "bf16"


def test_yaml_scientific_notation_without_dot_is_a_float(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  lr: 3e-4\n  muon_lr: 2E-2\n")
    cfg = load_config(path)
    assert cfg.optimizer.lr == pytest.approx(3e-4) and cfg.optimizer.muon_lr == pytest.approx(0.02)


def test_yaml_json_and_dict_give_the_same_config(tmp_path):
    raw = {"optimizer": {"name": "muon", "lr": 0.001}, "run": {"max_steps": 3}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    (tmp_path / "c.json").write_text(json.dumps(raw))
    dicts = [load_config(src).to_dict() for src in (raw, tmp_path / "c.yaml", tmp_path / "c.json")]
    assert dicts[0] == dicts[1] == dicts[2]


def test_malformed_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  max_steps: [1, 2\n")
    with pytest.raises(ConfigError, match="malformed"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(top)


def test_empty_file_gives_defaults(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty).to_dict() == SpeedtronicConfig().finalize().to_dict()


def test_overrides_are_yaml_typed_and_checked():
    cfg = load_config({"optimizer": "muon"}, ["optimizer.muon_lr=0.05", "compile=true",
                                             "run.max_steps=12", "optimizer.betas=[0.8, 0.9]"])
    assert cfg.optimizer.name == "muon" and cfg.optimizer.muon_lr == 0.05
    assert cfg.compile is True and cfg.run.max_steps == 12 and cfg.optimizer.betas == (0.8, 0.9)
    with pytest.raises(ConfigError, match="run.max_stepz"):
        load_config({}, ["run.max_stepz=3"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config({}, ["run.max_steps"])


def test_redaction_of_secrets_and_url_credentials(tmp_path):
    cfg = load_config({"distributed": {"store": "s3://AKIA:sekrit@bucket/prefix"}})
    text = json.dumps(cfg.to_dict())
    assert "sekrit" not in text and "AKIA" not in text and "<redacted>" in text
    cfg.save(tmp_path / "resolved.yaml")
    assert "sekrit" not in (tmp_path / "resolved.yaml").read_text()
    assert load_config(tmp_path / "resolved.yaml").distributed.store.startswith("s3://<redacted>@")


def test_saved_config_round_trips(tmp_path):
    cfg = load_config({"optimizer": "muon", "seed": 11, "model": {"d_ff": 96}})
    cfg.save(tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml").to_dict() == cfg.to_dict()
