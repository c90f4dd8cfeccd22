"""The model registry (models/registry.py) and the one loss rule (models/loss.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from _model_fixtures import tiny

from speedtronic.config import ConfigError, ModelConfig
from speedtronic.errors import SpeedtronicError
from speedtronic.models import build_model, extract_loss, register_model, registered_models
from speedtronic.models import reference as ref


def test_registry_unknown_name_lists_registered():
    with pytest.raises(ConfigError, match="registered models: .*reference_transformer"):
        build_model(ModelConfig(name="nope"))
    assert {"gpt", "reference_transformer"} <= set(registered_models())


def test_register_user_model_and_import_string(monkeypatch):
    class Linear(torch.nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.emb = torch.nn.Embedding(cfg.vocab_size, 4)

        def forward(self, input_ids, labels=None):
            return {"loss": self.emb(input_ids).pow(2).mean()}

    @register_model("test-user-model")
    def factory(cfg):
        return Linear(cfg)

    model = build_model(ModelConfig(name="test-user-model", vocab_size=10))
    assert isinstance(model, Linear)
    module = types.ModuleType("speedtronic_test_user_models")
    module.make = factory
    monkeypatch.setitem(sys.modules, "speedtronic_test_user_models", module)
    assert isinstance(build_model(ModelConfig(name="speedtronic_test_user_models:make")), Linear)
    with pytest.raises(ConfigError, match="no callable 'missing'"):
        build_model(ModelConfig(name="speedtronic_test_user_models:missing"))
    module.no_args = lambda: Linear(ModelConfig(vocab_size=10))  # a factory without cfg
    with pytest.raises(ConfigError, match=r"model.name: .*cannot be called as factory\(cfg\)"):
        build_model(ModelConfig(name="speedtronic_test_user_models:no_args"))
    with pytest.raises(ConfigError, match="set_gradient_checkpointing"):
        build_model(ModelConfig(name="test-user-model", gradient_checkpointing=True))
    # a module whose __getattr__ raises ImportError (speedtronic's own, for 2.0's GPT) is a
    # config error naming the cause, not a traceback
    with pytest.raises(ConfigError, match="model.name: 'speedtronic:GPT': speedtronic.GPT was "
                                          "speedtronic 2.0's"):
        build_model(ModelConfig(name="speedtronic:GPT"))
    register_model("test-not-a-module", lambda cfg: "oops")
    with pytest.raises(SpeedtronicError, match="expected a torch.nn.Module"):
        build_model(ModelConfig(name="test-not-a-module"))


def test_extract_loss_forms_and_errors():
    t = torch.tensor(2.5)
    assert extract_loss(t) is not None and extract_loss(t).item() == 2.5
    assert extract_loss({"loss": t, "logits": None}).item() == 2.5
    assert extract_loss((t, "extra")).item() == 2.5
    assert extract_loss(torch.tensor([2.5])).shape == ()
    with pytest.raises(SpeedtronicError, match="without 'loss'"):
        extract_loss({"logits": t})
    with pytest.raises(SpeedtronicError, match="shape"):
        extract_loss(torch.ones(3))
    with pytest.raises(SpeedtronicError, match="got float"):
        extract_loss(2.5)


def test_builtins_are_import_strings_and_a_user_registration_wins(monkeypatch):
    from speedtronic.models import registry

    for name, spec in registry.BUILTIN_MODELS.items():
        assert ":" in spec and name in registered_models()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    marker = torch.nn.Linear(1, 1)
    register_model("gpt", lambda cfg: marker)
    assert build_model(tiny(name="gpt")) is marker
    assert isinstance(build_model(tiny(name="reference_transformer")), ref.ReferenceTransformer)
