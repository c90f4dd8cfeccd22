"""``speedtronic sample`` and ``speedtronic export``: deterministic text from a run, and a
LlamaForCausalLM folder whose logits (and greedy decode) match ours."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
import yaml
from _engine_fixtures import TinyLM, one_thread, tiny_raw  # noqa: F401

from speedtronic.cli import main
from speedtronic.config import ConfigError, load_config
from speedtronic.models.export import export_hf
from speedtronic.models.generate import generate
from speedtronic.train.run_model import load_run_model
from speedtronic.train.runtime import train_from_config

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A 6-step reference run with grouped K/V heads and an untied head (both export paths)."""
    out = tmp_path_factory.mktemp("runs")
    raw = tiny_raw(out, "r", model={"d_model": 32, "n_layer": 2, "n_head": 4, "n_kv_head": 2,
                                    "tie_weights": False, "rope_base": 5000.0},
                   run={"max_steps": 6, "eval_every": 0})
    train_from_config(load_config(raw), plot=False)
    return out / "r"


def test_export_loads_in_transformers_with_equal_logits(run_dir, tmp_path, capsys):
    assert main(["export", str(run_dir), "-o", str(tmp_path / "hf")]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours, _, _ = load_run_model(run_dir)
    x = torch.randint(0, ours.vocab_size, (2, 32))
    with torch.no_grad():
        diff = (ours(x) - hf(input_ids=x).logits).abs().max().item()
    assert type(hf).__name__ == "LlamaForCausalLM" and diff <= 1e-5
    # a byte-level run has no end-of-text id: null, not Llama's defaults (eos 2 is a byte here)
    assert (hf.config.bos_token_id, hf.config.eos_token_id) == (None, None)
    # every file as the umask makes new files (safetensors alone wrote model.safetensors 0600)
    import os

    umask = os.umask(0)
    os.umask(umask)
    assert {f.stat().st_mode & 0o777 for f in (tmp_path / "hf").iterdir()} == {0o666 & ~umask}


def _bpe_with_end_of_text():
    """A byte-level BPE of 300 ids with an <|endoftext|> token, trained here in a blink."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["some text to learn from"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def test_export_writes_the_runs_end_of_text_token(tmp_path, capsys):
    """config.json had no special-token ids (transformers then said eos 2, a '"' in that run's
    vocabulary) and the copied tokenizer no eos_token."""
    tok = _bpe_with_end_of_text()
    tok.save(str(tmp_path / "tokenizer.json"))
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("some text to learn from\n" * 400)
    raw = tiny_raw(tmp_path / "runs", "t", model={"d_model": 32, "n_layer": 1, "n_head": 2},
                   run={"max_steps": 2, "eval_every": 0},
                   data={"tokenizer": str(tmp_path / "tokenizer.json"), "text_path": str(texts),
                         "prepare_dir": str(tmp_path / "prepared"), "prepare_workers": 1})
    train_from_config(load_config(raw), plot=False)
    assert main(["export", str(tmp_path / "runs" / "t"), "-o", str(tmp_path / "hf")]) == 0
    eos = tok.token_to_id("<|endoftext|>")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert (config.bos_token_id, config.eos_token_id) == (None, eos)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert loaded.eos_token == "<|endoftext|>" and loaded.eos_token_id == eos


def test_a_run_with_a_relative_tokenizer_samples_and_exports_from_any_folder(
        tmp_path, capsys, monkeypatch):
    """config.yaml keeps data.tokenizer as given (relative to where train ran): sample and
    export from another folder failed with "data.tokenizer: file not found"."""
    tok = _bpe_with_end_of_text()
    project = tmp_path / "project"
    (project / "texts").mkdir(parents=True)
    tok.save(str(project / "tokenizer.json"))
    (project / "texts" / "a.txt").write_text("some text to learn from\n" * 400)
    monkeypatch.chdir(project)
    raw = tiny_raw(Path("runs/exp"), "t", model={"d_model": 32, "n_layer": 1, "n_head": 2},
                   run={"max_steps": 2, "eval_every": 0},
                   data={"tokenizer": "tokenizer.json", "text_path": "texts",
                         "prepare_dir": "prepared", "prepare_workers": 1})
    train_from_config(load_config(raw), plot=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    run = str(project / "runs" / "exp" / "t")
    assert main(["export", run, "-o", "hf"]) == 0
    assert "tokenizer.json copied" in capsys.readouterr().out
    assert main(["sample", run, "--prompt", "some", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("some")


def test_greedy_sampling_matches_transformers_generate(run_dir, tmp_path):
    ours, cfg, _ = load_run_model(run_dir)
    export_hf(ours, cfg.model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = [int(b) for b in b"def f(x):"]
    mine = generate(ours, prompt, 16, temperature=0, max_seq_len=cfg.model.max_seq_len)
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                         pad_token_id=0)[0, len(prompt):].tolist()
    assert mine == theirs


def test_sample_is_deterministic_for_a_seed(run_dir, capsys):
    texts = []
    for seed in (3, 3, 4):
        assert main(["sample", str(run_dir), "--prompt", "import ", "--max-new-tokens", "24",
                     "--seed", str(seed)]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("import ")
    assert texts[0] != texts[2]


def test_sample_prints_to_a_stdout_that_cannot_encode_the_text(run_dir, monkeypatch):
    """A Windows pipe or file is cp1252: printing a U+FFFD or a check mark raised UnicodeEncodeError
    (exit 2, after the whole sample ran). What the encoding lacks becomes '?'."""
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="cp1252"))
    assert main(["sample", str(run_dir), "--prompt", "ok = '\u2713' ", "--max-new-tokens",
                 "8", "--seed", "1"]) == 0
    sys.stdout.flush()
    assert raw.getvalue().startswith(b"ok = '?' ")


@pytest.mark.parametrize("temperature", [1e-45, 5e-324])
def test_a_tiny_temperature_samples_the_greedy_tokens(run_dir, temperature):
    """logits / 1e-45 overflowed to inf and softmax to NaN: torch.multinomial raised."""
    model, cfg, _ = load_run_model(run_dir)
    prompt = [int(b) for b in b"def f(x):"]
    greedy = generate(model, prompt, 12, temperature=0, max_seq_len=cfg.model.max_seq_len)
    assert generate(model, prompt, 12, temperature=temperature, seed=5,
                    max_seq_len=cfg.model.max_seq_len) == greedy


def test_sample_and_export_refuse_what_they_cannot_do(tmp_path, capsys):
    assert main(["sample", str(tmp_path)]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no known Hugging Face layout"):
        export_hf(TinyLM(), load_config({}).model, tmp_path / "out")


def test_export_never_overwrites_a_foreign_folder_and_replaces_its_own_whole(run_dir, tmp_path,
                                                                             capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": 1}')
    assert main(["export", str(run_dir), "-o", str(mine)]) == 2
    assert "was not written by speedtronic export" in capsys.readouterr().err
    assert (mine / "config.json").read_text() == '{"mine": 1}'
    # a re-export replaces an earlier one whole: a file the new one does not write is gone
    out = tmp_path / "hf"
    assert main(["export", str(run_dir), "-o", str(out)]) == 0
    (out / "tokenizer.json").write_text("{}")
    assert main(["export", str(run_dir), "-o", str(out)]) == 0
    assert "no tokenizer" in capsys.readouterr().out
    assert not (out / "tokenizer.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mine"]  # no staging left
    (tmp_path / "afile").write_text("")
    assert main(["export", str(run_dir), "-o", str(tmp_path / "afile")]) == 2
    assert "is not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0 = greedy), got nan"),
    (["--top-k", "-1"], "--top-k must be >= 0 (0 = all), got -1"),
    (["--prompt", "\udcff"], "--prompt is not valid UTF-8"),
])
def test_sample_refuses_bad_options_in_one_line(run_dir, capsys, argv, message):
    assert main(["sample", str(run_dir), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_missing_or_foreign_checkpoint_is_named_in_one_line(run_dir, tmp_path, capsys):
    assert main(["sample", str(run_dir), "--checkpoint", str(tmp_path / "none.pt")]) == 2
    assert "none.pt' does not exist" in capsys.readouterr().err
    other = tmp_path / "other"
    raw = tiny_raw(other, "o", model={"d_model": 64, "n_layer": 1, "n_head": 4},
                   run={"max_steps": 1, "eval_every": 0})
    train_from_config(load_config(raw), plot=False)
    (foreign,) = (other / "o" / "checkpoints").glob("step_*.pt")
    assert main(["export", str(run_dir), "--checkpoint", str(foreign), "-o",
                 str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err  # the tensors, not only torch's "Error(s) in loading ..."
    assert "does not fit the model" in err and "size mismatch for" in err


def test_a_hf_run_exports_with_save_pretrained(tmp_path, capsys):
    raw = tiny_raw(tmp_path, "h", run={"max_steps": 2, "eval_every": 0},
                   model={"name": "hf", "hf_config": {"model_type": "gpt2", "n_embd": 32,
                                                      "n_layer": 1, "n_head": 2,
                                                      "n_positions": 64}})
    cfg_path = tmp_path / "h.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    assert main(["train", "--config", str(cfg_path)]) == 0
    assert main(["export", str(tmp_path / "h")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "h" / "hf")
    assert type(hf).__name__ == "GPT2LMHeadModel"
