"""Hugging Face causal LMs through the engine: model.name: hf and user factories, with the loss
of the model's own label shift (never a second shift), hybrid routing, and clear refusals."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
import yaml

pytest.importorskip("transformers")

from speedtronic.cli import main  # noqa: E402
from speedtronic.config import ConfigError, load_config  # noqa: E402
from speedtronic.models import build_model  # noqa: E402
from speedtronic.models.hf import HFCausalLM  # noqa: E402
from speedtronic.train.metrics import read_metrics  # noqa: E402

TINY = {
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64},
    "llama": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64},
}


@pytest.mark.parametrize("family", sorted(TINY))
def test_the_loss_is_the_models_own_shifted_loss(family):
    """Our labels are already shifted; the model's own loss on the unshifted batch is the
    reference (a wrapper passing labels= shifted them twice: eval 2.758 vs 2.497)."""
    cfg = load_config({"model": {"name": "hf", "hf_config": TINY[family], "max_seq_len": 32,
                                 "vocab_size": 300}})
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    assert isinstance(model, HFCausalLM) and model.hf.config.vocab_size == 300
    full = torch.randint(0, 300, (2, 33))
    ours = model(full[:, :-1], full[:, 1:])
    theirs = model.hf(input_ids=full, labels=full).loss
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    masked = full[:, 1:].clone()
    masked[:, :5] = -100
    assert torch.isfinite(model(full[:, :-1], masked))


def _train_yaml(tmp_path, model: dict) -> str:
    raw = {"run": {"name": "hf", "max_steps": 4, "eval_every": 2, "eval_batches": 2,
                   "output_dir": str(tmp_path)},
           "model": {"max_seq_len": 32, **model}, "optimizer": {"name": "muon"},
           "data": {"micro_batch_size": 4, "stdlib_max_bytes": 300_000},
           "logging": {"every_steps": 2, "progress_bar": False}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.parametrize("family", sorted(TINY))
def test_speedtronic_train_trains_a_hf_model_with_hybrid_routing(tmp_path, capsys, family):
    cfg = _train_yaml(tmp_path, {"name": "hf", "hf_config": TINY[family]})
    assert main(["train", "--config", cfg]) == 0
    out = capsys.readouterr().out
    assert "optimizer: muon (muon " in out and "muon 0 tensors" not in out
    rows = [r for r in read_metrics(tmp_path / "hf" / "metrics.jsonl")
            if r["event"] == "train_step"]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)


def test_a_factory_returning_a_hf_model_is_wrapped(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_hf_models.py").write_text(textwrap.dedent("""
        import transformers
        def build(cfg):
            c = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                        vocab_size=cfg.vocab_size)
            return transformers.GPT2LMHeadModel(c)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _train_yaml(tmp_path, {"name": "my_hf_models:build"})
    assert main(["train", "--config", cfg]) == 0
    sys.modules.pop("my_hf_models", None)


def test_a_forward_of_no_supported_form_is_one_clear_error(tmp_path, capsys, monkeypatch):
    (tmp_path / "odd_models.py").write_text(textwrap.dedent("""
        import torch
        class Odd(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Linear(4, 4)
            def forward(self, x):
                return self.w(x)
        def build(cfg):
            return Odd()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _train_yaml(tmp_path, {"name": "odd_models:build"})
    assert main(["train", "--config", cfg]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "forward(input_ids, labels)" in err
    assert "Hugging Face" in err
    sys.modules.pop("odd_models", None)


def test_hf_config_from_a_local_folder(tmp_path):
    import transformers

    transformers.LlamaConfig(**{k: v for k, v in TINY["llama"].items()
                                if k != "model_type"}).save_pretrained(tmp_path / "cfg")
    cfg = load_config({"model": {"name": "hf", "hf_config": str(tmp_path / "cfg"),
                                 "max_seq_len": 32, "vocab_size": 128}})
    model = build_model(cfg.model)
    assert type(model.hf).__name__ == "LlamaForCausalLM" and model.hf.config.vocab_size == 128


def test_special_ids_beyond_the_data_vocabulary_are_dropped():
    """GPT-2's config keeps bos/eos 50256; at the data's 256 ids transformers warned on every
    load of the export."""
    model = build_model(load_config({"model": {"name": "hf", "hf_config": TINY["gpt2"],
                                               "max_seq_len": 32}}).model)
    config = model.hf.config
    assert config.vocab_size == 256 and config.bos_token_id is None
    assert config.eos_token_id is None


def test_an_encoder_family_is_built_causal():
    """bert as AutoModelForCausalLM attended to later tokens unless is_decoder."""
    spec = {"model_type": "bert", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64}
    model = build_model(load_config({"model": {"name": "hf", "hf_config": spec,
                                               "max_seq_len": 32}}).model).eval()
    x = torch.randint(0, 256, (1, 8))
    y = x.clone()
    y[0, 5] = (x[0, 5] + 1) % 256
    with torch.no_grad():
        a, b = (model.hf(input_ids=t).logits[0, :5] for t in (x, y))
    torch.testing.assert_close(a, b)  # positions before 5 do not see token 5


@pytest.mark.parametrize(("model", "message"), [
    ({"name": "reference_transformer", "hf_config": {"model_type": "llama"}},
     "model.hf_config: is only read with model.name: hf"),
    ({"name": "hf"}, "model.hf_config: required"),
    ({"name": "hf", "hf_config": {"model_type": "no_such_type"}}, "model.hf_config:"),
    ({"name": "hf", "hf_config": "/no/such/folder"}, "has no config.json"),
    ({"name": "hf", "hf_config": TINY["gpt2"], "max_seq_len": 128}, "exceeds the Hugging Face"),
    # bytes need 256 ids: a smaller explicit vocabulary was an IndexError at the first step
    ({"name": "hf", "hf_config": {**TINY["llama"], "vocab_size": 100}},
     r"model.hf_config.vocab_size: 100 is smaller than the data's vocabulary"),
])
def test_bad_hf_configs_are_config_errors(model, message):
    with pytest.raises(ConfigError, match=message):
        build_model(load_config({"model": model}).model)
