"""Compare variants (compare/variants.py): presets, custom variants, shorthands, bad specs."""

from __future__ import annotations

import pytest
from _compare_fixtures import TINY

from speedtronic.compare import PRESETS, parse_variant, parse_variants
from speedtronic.config import ConfigError, load_config


# ------------------------------------------------------------------------------ variants
def test_bare_preset_and_preset_with_overrides():
    v = parse_variant("muon")
    assert v.preset == "muon" and v.overrides == PRESETS["muon"]
    v = parse_variant("muon_plus:optimizer.muon_lr=0.05")
    assert v.overrides[-1] == "optimizer.muon_lr=0.05" and v.overrides[:-1] == PRESETS["muon_plus"]


def test_custom_variant_keeps_brackets_and_maps_shorthands():
    v = parse_variant("mine:optimizer.name=muon,optimizer.betas=[0.9, 0.99],cautious=true")
    assert v.preset is None
    assert v.overrides == ("optimizer.name=muon", "optimizer.betas=[0.9, 0.99]",
                           "optimizer.cautious=true")
    cfg = load_config(TINY, list(v.overrides))
    assert cfg.optimizer.betas == (0.9, 0.99) and cfg.optimizer.cautious


def test_no_variant_means_all_presets_adamw_first():
    names = [v.name for v in parse_variants(None)]
    assert names == list(PRESETS) and names[0] == "adamw"
    assert set(names) == {"adamw", "muon", "muon_plus", "cautious_adamw", "cautious_muon"}


def test_presets_resolve_to_the_intended_optimizer():
    for name, (opt, plus, cautious) in {
            "adamw": ("adamw", False, False), "muon": ("muon", False, False),
            "muon_plus": ("muon", True, False), "cautious_adamw": ("adamw", False, True),
            "cautious_muon": ("muon", False, True)}.items():
        # The base says cautious: true; a preset must not inherit it.
        o = load_config({**TINY, "cautious": True}, list(PRESETS[name])).optimizer
        assert (o.name, o.muon_plus, o.cautious) == (opt, plus, cautious), name


@pytest.mark.parametrize("spec, message", [
    ("nosuch", "unknown preset; presets: adamw, muon, muon_plus, cautious_adamw, cautious_muon"),
    ("x:model.n_layer=2", "key 'model.n_layer' cannot vary"),
    ("x:seed=4", "key 'seed' cannot vary"),
    ("x:optimizer.lr=1,optimizer.lr=2", "given twice"),
    ("x:optimizer.lr", "expected key=value"),
    ("x:optimizer.betas=[0.9", "unbalanced"),
    ("bad/name:optimizer.lr=1", "the name must be"),
])
def test_bad_variant_specs_are_clear(spec, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        parse_variant(spec)


def test_duplicate_variant_names_refused():
    with pytest.raises(ConfigError, match="duplicate variant name"):
        parse_variants(["muon", "muon:optimizer.muon_lr=0.05"])


def test_a_swept_variant_is_labelled_with_the_chosen_lr_not_the_one_it_replaced():
    from speedtronic.compare.api import _described

    v = parse_variant("mine:optimizer.name=muon,optimizer.muon_lr=0.05,cautious=true")
    label = _described(v, {"key": "optimizer.muon_lr", "chosen": 0.1})
    assert "muon_lr=0.05" not in label and "optimizer.muon_lr=0.1 (swept)" in label
    assert "optimizer.cautious=true" in label
    assert _described(v, None) == v.describe()
