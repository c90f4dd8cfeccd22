"""speedtronic 2.0's config keys and values that this version does not have: each is refused
with its replacement, never a look-alike key (``distributed.repo_id`` once suggested
``distributed.node_id``), and docs/configuration.md lists every one."""

from __future__ import annotations

from pathlib import Path

import pytest

from speedtronic.cli import main
from speedtronic.config import ConfigError, load_config
from speedtronic.config.v2_keys import V2_REMOVED_KEYS, V2_REMOVED_VALUES

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _nested(dotted: str, value: object) -> dict:
    section, key = dotted.split(".")
    return {section: {key: value}}


@pytest.mark.parametrize("dotted", sorted(V2_REMOVED_KEYS))
def test_a_2_0_key_names_its_replacement(dotted: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(_nested(dotted, 1))
    message = str(caught.value)
    assert message.startswith(f"'{dotted}' is a speedtronic 2.0 key")
    assert "did you mean" not in message
    assert message.endswith(V2_REMOVED_KEYS[dotted])


def test_a_2_0_value_names_its_replacement_and_others_keep_the_usual_error() -> None:
    for (dotted, value), advice in V2_REMOVED_VALUES.items():
        with pytest.raises(ConfigError, match="speedtronic 2.0 value") as caught:
            load_config(_nested(dotted, value))
        assert str(caught.value).endswith(advice)
    with pytest.raises(ConfigError, match=r"distributed.role: expected 'master' \| 'worker'"):
        load_config({"distributed": {"role": "boss"}})
    with pytest.raises(ConfigError, match="did you mean 'run.max_steps'"):  # not a 2.0 key
        load_config({"run": {"max_stepz": 3}})


def test_the_cli_refuses_a_2_0_key_in_one_line_exit_2(tmp_path, capsys) -> None:
    cfg = tmp_path / "v2.yaml"
    cfg.write_text("run:\n  max_steps: 3\ndistributed:\n  repo_id: me/diloco\n")
    assert main(["validate", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "distributed.store: hf://owner/name" in err[0]


def test_docs_list_every_2_0_key() -> None:
    text = DOCS.read_text()
    section = text[text.index("## Differences from the v2.0"):text.index("## Keys")]
    for dotted in V2_REMOVED_KEYS:
        assert f"`{dotted}`" in section, dotted
    for dotted, value in V2_REMOVED_VALUES:
        assert f"`{dotted}: {value}`" in section


def test_from_dict_and_from_yaml_are_load_config_and_round_trip_to_dict(tmp_path) -> None:
    from speedtronic.config import SpeedtronicConfig

    cfg = load_config({"run": {"max_steps": 7}, "optimizer": "muon"})
    again = SpeedtronicConfig.from_dict(cfg.to_dict(redact=False))
    assert again.to_dict(redact=False) == cfg.to_dict(redact=False)
    path = tmp_path / "c.yaml"
    path.write_text("max_steps: 9\n")  # the root shorthand 2.0's examples use
    assert SpeedtronicConfig.from_yaml(path).run.max_steps == 9
    with pytest.raises(ConfigError, match="speedtronic 2.0 key"):
        SpeedtronicConfig.from_dict({"data": {"max_steps": 3}})


def test_load_yaml_config_is_served_as_load_config_with_a_warning() -> None:
    import speedtronic.config as config_module

    with pytest.warns(DeprecationWarning, match="load_yaml_config is now load_config"):
        assert config_module.load_yaml_config is load_config
    with pytest.raises(AttributeError):
        getattr(config_module, "no_such_name")  # noqa: B009
