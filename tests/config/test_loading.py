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
    ({"log_every": 5, "logging": {"every_steps": 20}}, "logging.every_steps"),  # was silent
])
def test_conflicting_shorthands_are_errors(raw, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(raw)


def test_same_value_in_both_places_is_fine():
    assert load_config({"seed": 5, "run": {"seed": 5}}).run.seed == 5
    assert load_config({"log_every": 5, "logging": {"every_steps": 5}}).logging.every_steps == 5


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
    ({"checkpoint": {"directory": "/elsewhere/ckpt"}}, "checkpoint.directory"),
    ({"checkpoint": {"directory": "../shared"}}, "checkpoint.directory"),
    ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last"),  # would prune every save
    ({"distributed": {"num_shards": 0}}, "distributed.num_shards"),  # was named as .shard
    ({"checkpoint": {"every_seconds": 0}}, "checkpoint.every_seconds"),
    ({"train": {"max_skipped_steps": 0}}, "train.max_skipped_steps"),
    ({"distributed": {"store": "file:///tmp/s", "endpoint_url": "http://minio:9000"}},
     "distributed.endpoint_url"),
    ({"distributed": {"store": "s3://b/p", "endpoint_url": "minio:9000"}},
     "distributed.endpoint_url"),
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


def test_empty_file_gives_defaults_and_says_so(tmp_path, caplog):
    import logging

    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing set\n")
    with caplog.at_level(logging.WARNING, logger="speedtronic.config"):
        assert load_config(empty).to_dict() == SpeedtronicConfig().finalize().to_dict()
    assert f"config file {empty} is empty: every key takes its default" in caplog.text


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


# ------------------------------------------------------------------ non-finite floats
@pytest.mark.parametrize("override, message", [
    ("optimizer.lr=.inf", "optimizer.lr: must be a finite number, got inf"),
    ("optimizer.weight_decay=.inf", "optimizer.weight_decay: must be a finite number, got inf"),
    ("optimizer.eps=.inf", "optimizer.eps: must be a finite number, got inf"),
    ("model.rope_base=.inf", "model.rope_base: must be a finite number, got inf"),
    ("distributed.outer_lr=.inf", "distributed.outer_lr: must be a finite number, got inf"),
    ("run.peak_tflops=-.inf", "run.peak_tflops: must be a finite number, got -inf"),
    ("optimizer.lr=.nan", "optimizer.lr: must be a finite number, got nan"),
    ("optimizer.muon_coefficients=[.nan, 1, 1]",
     "optimizer.muon_coefficients: every item must be a finite number, got [nan, 1.0, 1.0]"),
    ("optimizer.betas=[0.9, .inf]",
     "optimizer.betas: every item must be a finite number, got [0.9, inf]"),
])
def test_non_finite_floats_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError) as info:
        load_config({}, [override])
    assert str(info.value) == message


def _float_fields() -> list[tuple[str, str, str]]:
    """(section, key, annotation) of every float-typed field of every section."""
    import dataclasses

    out = []
    for section in dataclasses.fields(SpeedtronicConfig):
        if section.default_factory is dataclasses.MISSING:  # a root switch
            assert "float" not in str(section.type), "extend this test to root floats"
            continue
        out += [(section.name, f.name, str(f.type))
                for f in dataclasses.fields(section.default_factory) if "float" in str(f.type)]
    return out


_NO_LIMIT = {"distributed.start_timeout", "distributed.shutdown_timeout",
             "distributed.final_sync_timeout", "distributed.master_idle_timeout",
             "distributed.unapplied_wait"}


def test_every_float_field_refuses_inf_except_the_no_limit_waits():
    fields = _float_fields()
    assert len(fields) > 25  # the walk found the schema's floats
    for section, key, annotation in fields:
        dotted = f"{section}.{key}"
        value = [float("inf")] * annotation.count("float") if "[" in annotation \
            else float("inf")  # tuple[float, float] -> 2 items, list[float] -> 1
        if dotted in _NO_LIMIT:
            assert getattr(getattr(load_config({section: {key: value}}), section), key) \
                == float("inf")
            continue
        with pytest.raises(ConfigError, match=rf"^{dotted.replace('.', '[.]')}: .*finite"):
            load_config({section: {key: value}})


def test_no_limit_waits_take_inf_but_not_nan_and_round_trip(tmp_path):
    cfg = load_config({}, ["distributed.start_timeout=.inf",
                           "distributed.master_idle_timeout=.inf"])
    assert cfg.distributed.start_timeout == cfg.distributed.master_idle_timeout == float("inf")
    cfg.save(tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml").to_dict() == cfg.to_dict()
    with pytest.raises(ConfigError, match=r"distributed\.shutdown_timeout: must be a finite "
                                          r"number or \.inf \(no limit\), got nan"):
        load_config({}, ["distributed.shutdown_timeout=.nan"])
    with pytest.raises(ConfigError, match=r"got -inf"):
        load_config({}, ["distributed.start_timeout=-.inf"])


def test_configs_built_in_python_are_checked_too():
    from speedtronic.config import OptimizerConfig

    cfg = SpeedtronicConfig(optimizer=OptimizerConfig(lr=float("inf")))
    with pytest.raises(ConfigError, match=r"optimizer\.lr: must be a finite number"):
        cfg.finalize()


# ------------------------------------------------------------------ shorthand overrides
def test_section_shorthand_override_sets_only_its_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer: {lr: 0.005, weight_decay: 0.0}\nprecision: {mode: fp32}\n")
    cfg = load_config(path, ["optimizer=muon", "precision=bf16"])
    assert cfg.optimizer.name == "muon"
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay) == (0.005, 0.0)
    assert cfg.precision.mode == "bf16"
    # a mapping still replaces the whole section, as any YAML value replaces its key
    assert load_config(path, ["optimizer={name: muon}"]).optimizer.lr == 3e-4


@pytest.mark.parametrize("override", ["optimizer=", "optimizer=null", "run=~", "data= "])
def test_an_empty_section_override_is_refused_not_a_silent_reset(tmp_path, override):
    """`--set optimizer=$UNSET` once reset the whole section to defaults and trained anyway."""
    path = tmp_path / "c.yaml"
    path.write_text("optimizer: {name: muon, lr: 0.005}\n")
    section = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"empty value for the whole '{section}' section.*"
                                          rf"{section}={{}}"):
        load_config(path, [override])
    assert load_config(path, ["optimizer={}"]).optimizer.name == "adamw"  # the explicit reset


def test_root_shorthand_overrides_replace_the_files_long_form(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run: {name: a, seed: 3}\noptimizer: {cautious: false}\n"
                    "logging: {every_steps: 7}\ndiloco: {inner_steps: 9}\n")
    cfg = load_config(path, ["name=b", "seed=4", "cautious=true", "log_every=3",
                             "diloco.inner_steps=11"])
    assert (cfg.run.name, cfg.run.seed, cfg.optimizer.cautious) == ("b", 4, True)
    assert (cfg.logging.every_steps, cfg.distributed.inner_steps) == (3, 11)
    with pytest.raises(ConfigError, match=r"optimizer\.name: expected 'adamw' \| 'muon'"):
        load_config(path, ["optimizer=sgd"])


# ------------------------------------------------------------------ duplicate keys
@pytest.mark.parametrize("name, text, where, key", [
    ("top.yaml", "optimizer: {lr: 0.1}\nrun: {name: a}\nrun: {name: b}\n", "line 3", "run"),
    ("nested.yaml", "run:\n  name: a\n  seed: 1\n  name: b\n", "line 4", "name"),
    ("flow.yaml", "run: {seed: 1, seed: 2}\n", "line 1", "seed"),
    ("dup.json", '{"run": {"name": "a"},\n "run": {"name": "b"}}\n', "line 2", "run"),
])
def test_duplicate_keys_are_refused_naming_key_file_and_line(tmp_path, name, text, where, key):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {where},") and f"duplicate key '{key}'" in message


def test_yaml_merge_keys_may_still_be_overridden(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("optimizer:\n  <<: {lr: 0.1, eps: 1.0e-6}\n  lr: 0.2\n")
    cfg = load_config(path)
    assert (cfg.optimizer.lr, cfg.optimizer.eps) == (0.2, 1e-6)


def test_a_fixed_length_list_says_how_many_items():
    with pytest.raises(ConfigError, match=r"optimizer.betas: expected a list of 2 floats, got "
                                          r"list \[0.9\]"):
        load_config({"optimizer": {"betas": [0.9]}})


def test_unquoted_on_and_off_in_yaml_mean_the_choices_on_and_off(tmp_path):
    """YAML 1.1 reads on / off as booleans: `cuda_graph: on`, as the docs write it, was refused
    as "got bool True". A boolean maps to a choice named on / off only where one exists."""
    path = tmp_path / "run.yaml"
    path.write_text("optimizer:\n  name: muon\n  cuda_graph: on\ntorchft:\n  mode: off\n")
    cfg = load_config(path)
    assert (cfg.optimizer.cuda_graph, cfg.torchft.mode) == ("on", "off")
    assert load_config(path, ["optimizer.cuda_graph=off"]).optimizer.cuda_graph == "off"
    path.write_text("torchft:\n  mode: on\n")  # no choice named on: still an error
    with pytest.raises(ConfigError, match=r"torchft\.mode: expected 'off' \| 'ddp' \| 'diloco', "
                                          r"got bool True"):
        load_config(path)


def test_a_malformed_override_is_one_clean_line():
    """A character YAML refuses outright (no position) read "--set run.output_dir:: ..."."""
    with pytest.raises(ConfigError) as info:
        load_config({}, ["run.output_dir=\udcff"])
    assert str(info.value).startswith("--set run.output_dir: malformed YAML/JSON: ")
    with pytest.raises(ConfigError, match=r"^--set run.output_dir: line 1, column 6: malformed"):
        load_config({}, ["run.output_dir=[1, 2"])
