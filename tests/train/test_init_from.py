"""model.init_from: a fresh run starts from trained weights (a run directory, a checkpoint, a
Hugging Face folder), with a fresh optimizer; what does not fit is one clear error."""

from __future__ import annotations

import re

import pytest
import torch
from _engine_fixtures import one_thread, tiny_config  # noqa: F401

from speedtronic.config import ConfigError
from speedtronic.models.export import export_hf
from speedtronic.train.checkpoint import CheckpointManager
from speedtronic.train.runtime import build_trainer, train_from_config

MODEL = {"d_model": 32, "n_layer": 2, "n_head": 4, "n_kv_head": 2}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("src")
    train_from_config(tiny_config(out, "src", model=MODEL, run={"max_steps": 3,
                                                                "eval_every": 0}), plot=False)
    state, path = CheckpointManager(out / "src" / "checkpoints").load_latest()
    return out / "src", path, state["model"]


def _start(tmp_path, init_from, model=MODEL):
    trainer = build_trainer(tiny_config(tmp_path, "dst", model={**model, "init_from":
                                                                 str(init_from)}))
    trainer.release_run_lock()
    return trainer


@pytest.mark.parametrize("source", ["run_dir", "checkpoint"])
def test_init_from_our_run_or_checkpoint(tmp_path, trained, source):
    run_dir, ckpt, weights = trained
    trainer = _start(tmp_path, run_dir if source == "run_dir" else ckpt)
    state = trainer.model.state_dict()
    assert all(torch.equal(state[k], weights[k]) for k in weights)
    assert trainer.step == 0 and not trainer.optimizer.state  # weights only


def test_init_from_a_llama_folder_into_the_reference_model(tmp_path, trained):
    pytest.importorskip("safetensors")
    run_dir, _, weights = trained
    src = build_trainer(tiny_config(tmp_path / "x", "x", model=MODEL))
    src.release_run_lock()
    src.model.load_state_dict(weights)
    export_hf(src.model, src.config.model, tmp_path / "llama")
    state = _start(tmp_path, tmp_path / "llama").model.state_dict()
    assert all(torch.equal(state[k], weights[k]) for k in weights)


def test_init_from_a_hf_folder_into_a_hf_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    spec = {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 64,
            "vocab_size": 256}
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**spec))
    hf.save_pretrained(tmp_path / "gpt2")
    trainer = _start(tmp_path, tmp_path / "gpt2", model={"name": "hf", "hf_config": spec})
    ours = trainer.model.hf.state_dict()
    assert all(torch.equal(ours[k], v) for k, v in hf.state_dict().items())


def test_what_does_not_fit_is_one_clear_error(tmp_path, trained):
    run_dir, _, _ = trained
    with pytest.raises(ConfigError, match="model.init_from: .* does not fit this model"):
        _start(tmp_path, run_dir, model={**MODEL, "d_model": 64})
    with pytest.raises(ConfigError, match="does not exist"):
        _start(tmp_path, tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="neither model.safetensors"):
        _start(tmp_path, tmp_path / "empty")


def test_a_shape_compatible_architecture_change_is_refused(tmp_path, trained):
    """Loaded without a word before: the same tensors under another n_head, rope_base or tied
    head compute another function (resume refuses the same changes)."""
    run_dir, _, weights = trained
    with pytest.raises(ConfigError, match=r"another architecture: model.n_head is 8 here but 4"):
        _start(tmp_path, run_dir, model={**MODEL, "n_head": 8, "n_kv_head": 4})  # same shapes
    with pytest.raises(ConfigError, match=r"model.rope_base is 500.0 here"):
        _start(tmp_path, run_dir, model={**MODEL, "rope_base": 500.0})
    pytest.importorskip("safetensors")
    src = build_trainer(tiny_config(tmp_path / "x", "x", model=MODEL))
    src.release_run_lock()
    src.model.load_state_dict(weights)
    export_hf(src.model, src.config.model, tmp_path / "llama")
    with pytest.raises(ConfigError, match=r"config.json has rope_theta=10000.0 but this model "
                                          r"500.0"):
        _start(tmp_path, tmp_path / "llama", model={**MODEL, "rope_base": 500.0})


@pytest.mark.parametrize("edit, message", [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 16}},
     "rope_type='llama3' but this model 'default'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type='linear'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' but this model 'silu'"),
])
def test_a_llama_folder_with_rope_scaling_or_another_activation_is_refused(
        tmp_path, trained, edit, message):
    """Llama 3.1/3.2's rope scaling and a non-silu MLP loaded without a word: the same tensors
    computed logits ~14 (rope) and ~2 (gelu) away from the source's on a tiny model."""
    import json

    pytest.importorskip("safetensors")
    _, _, weights = trained
    src = build_trainer(tiny_config(tmp_path / "x", "x", model=MODEL))
    src.release_run_lock()
    src.model.load_state_dict(weights)
    folder = tmp_path / "llama"
    export_hf(src.model, src.config.model, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(edit)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=re.escape(message)):
        _start(tmp_path, folder, model=MODEL)


def test_a_hugging_face_folder_of_another_architecture_is_refused_on_the_hf_route(tmp_path):
    """model.name: hf with its own hf_config took a folder's same-shaped tensors without
    comparing configs: 8 heads over a 4-head folder's weights moved the logits by 13."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    spec = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 4, "max_position_embeddings": 64}
    hf = transformers.LlamaForCausalLM(transformers.AutoConfig.for_model(**spec))
    hf.save_pretrained(tmp_path / "llama")
    with pytest.raises(ConfigError, match=r"config.json has num_attention_heads=4 but this "
                                          r"model 8"):
        _start(tmp_path, tmp_path / "llama", model={
            "name": "hf", "hf_config": {**spec, "num_attention_heads": 8,
                                        "num_key_value_heads": 8, "head_dim": 8}})
    trainer = _start(tmp_path / "same", tmp_path / "llama",
                     model={"name": "hf", "hf_config": spec})  # the same config: loads
    assert all(torch.equal(trainer.model.hf.state_dict()[k], v)
               for k, v in hf.state_dict().items())


def test_a_hugging_face_model_passed_in_trains_as_a_factory_one_would(tmp_path):
    """train_from_config(model=<a PreTrainedModel>) called it with (input_ids, labels): the
    labels landed in attention_mask and no loss came back."""
    transformers = pytest.importorskip("transformers")
    from speedtronic.train.runtime import train_from_config

    hf = transformers.LlamaForCausalLM(transformers.AutoConfig.for_model(
        model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=64))
    before = hf.model.embed_tokens.weight.detach().clone()
    cfg = tiny_config(tmp_path, "hfin", model={**MODEL, "vocab_size": 256},
                      run={"max_steps": 2, "eval_every": 2}, checkpoint={"enabled": False})
    result = train_from_config(cfg, model=hf, plot=False)
    assert result.steps == 2 and result.final_eval_loss is not None
    assert not torch.equal(before, hf.model.embed_tokens.weight)  # the object passed in trained
