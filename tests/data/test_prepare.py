"""Tokenizers and ``speedtronic prepare`` (data/prepare.py), offline: a BPE trained here on the
stdlib corpus, text files and local Hugging Face datasets into cached shards, training from
each source, and the bad-input cases as one-line errors."""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")

from _data_fixtures import byte_level_bpe  # noqa: E402

from speedtronic.cli import main  # noqa: E402
from speedtronic.config import ConfigError, load_config  # noqa: E402
from speedtronic.data import build_data, check_data  # noqa: E402
from speedtronic.data.prepare import _source_fingerprint, prepare  # noqa: E402
from speedtronic.data.sources import stdlib_corpus  # noqa: E402
from speedtronic.train.runtime import train_from_config  # noqa: E402

MODEL = {"max_seq_len": 32, "n_layer": 1, "n_head": 2, "d_model": 16}


@pytest.fixture(scope="module")
def corpus_text() -> str:
    return bytes(stdlib_corpus(400_000, 0.1).train).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory, corpus_text) -> Path:
    """A byte-level BPE with 400 ids and an end-of-text token, trained offline right here."""
    return byte_level_bpe([corpus_text[i:i + 2000] for i in range(0, 200_000, 2000)], 400,
                          tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture
def text_dir(tmp_path, corpus_text) -> Path:
    d = tmp_path / "texts"
    d.mkdir()
    for i in range(3):
        (d / f"part{i}.txt").write_text(corpus_text[i * 30_000:(i + 1) * 30_000])
    return d


def cfg(tmp_path, data: dict, **model):
    return load_config({
        "model": {**MODEL, **model}, "data": {"micro_batch_size": 4, "prepare_workers": 1,
                                              "prepare_dir": str(tmp_path / "prepared"), **data},
        "run": {"output_dir": str(tmp_path / "runs"), "name": "t", "max_steps": 3,
                "eval_every": 3, "eval_batches": 1, "device": "cpu"},
        "checkpoint": {"enabled": False}, "logging": {"progress_bar": False},
        "optimizer": {"name": "adamw", "lr": 1e-3}})


def test_text_files_are_tokenized_once_and_cached(tmp_path, tokenizer_json, text_dir, caplog):
    c = cfg(tmp_path, {"tokenizer": str(tokenizer_json), "text_path": str(text_dir)})
    meta = prepare(c, workers=2)  # the parallel path
    assert meta["vocab_size"] == 400 and meta["tokens"] > 10_000 and meta["eos_id"] is not None
    shards = sorted(meta.directory.glob("shard_*.bin"))
    assert [p.name for p in shards] == sorted(meta["shards"])
    with caplog.at_level(logging.INFO, logger="speedtronic.data"):
        again = prepare(c)
    assert again["key"] == meta["key"] and "already in" in caplog.text
    # A changed source is a new key (size and modification time are part of it).
    (text_dir / "part0.txt").write_text("something else entirely\n")
    assert prepare(c)["key"] != meta["key"]


def test_a_prepare_dir_inside_the_text_is_never_read_as_text(tmp_path, tokenizer_json,
                                                              text_dir):
    """Its shards were read back as (binary) text: a new, larger corpus on every prepare."""
    inside = cfg(tmp_path, {"tokenizer": str(tokenizer_json), "text_path": str(text_dir),
                            "prepare_dir": str(text_dir / "tokens")})
    first = prepare(inside)
    again = prepare(inside)  # the shards now sit under text_path
    assert again["key"] == first["key"] and again["tokens"] == first["tokens"]


def test_parallel_and_serial_tokenization_agree(tmp_path, tokenizer_json, text_dir):
    a = prepare(cfg(tmp_path / "a", {"tokenizer": str(tokenizer_json),
                                     "text_path": str(text_dir)}), workers=1)
    b = prepare(cfg(tmp_path / "b", {"tokenizer": str(tokenizer_json),
                                     "text_path": str(text_dir)}), workers=2)
    assert a["tokens"] == b["tokens"] and a["shards"] == b["shards"]
    for name in a["shards"]:
        assert (a.directory / name).read_bytes() == (b.directory / name).read_bytes()


def test_blocks_tokenize_to_the_whole_files_ids(tmp_path, tokenizer_json, corpus_text,
                                               monkeypatch):
    """Files are tokenized in blocks (4 KiB here, 1 MiB by default): the cuts fall where
    byte-level BPE splits anyway, so the ids equal the whole file's (a cut inside a whitespace
    run once merged two newline tokens into one)."""
    from tokenizers import Tokenizer

    from speedtronic.data import prepare_sources

    monkeypatch.setattr(prepare_sources, "_TEXT_BLOCK", 4096)
    d = tmp_path / "code"
    d.mkdir()
    text = corpus_text[:120_000]
    assert text.count("\n\n    ") > 50  # blank lines before indented code: the risky cuts
    (d / "one.txt").write_text(text)
    meta = prepare(cfg(tmp_path, {"tokenizer": str(tokenizer_json), "text_path": str(d)}))
    from speedtronic.data.token_files import open_token_file

    ids = [int(t) for name in meta["shards"]
           for t in open_token_file(meta.directory / name, "auto", "test").tokens]
    tok = Tokenizer.from_file(str(tokenizer_json))
    assert ids == tok.encode(text, add_special_tokens=False).ids + [meta["eos_id"]]


def test_vocab_follows_the_tokenizer_and_a_run_trains(tmp_path, tokenizer_json, text_dir):
    c = cfg(tmp_path, {"tokenizer": str(tokenizer_json), "text_path": str(text_dir / "*.txt")})
    assert c.model.vocab_size is None
    result = train_from_config(c, plot=False)  # prepares on first use
    assert c.model.vocab_size == 400
    assert result.steps == 3 and result.final_eval_loss is not None


def test_a_vocab_smaller_than_the_tokenizer_is_refused(tmp_path, tokenizer_json, text_dir):
    c = cfg(tmp_path, {"tokenizer": str(tokenizer_json), "text_path": str(text_dir)},
            vocab_size=300)
    with pytest.raises(ConfigError, match="model.vocab_size: 300"):
        check_data(c)


def test_local_hf_dataset_offline_from_disk_and_from_data_files(tmp_path, tokenizer_json,
                                                                 corpus_text, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [{"text": corpus_text[i:i + 3000], "id": i} for i in range(0, 60_000, 3000)]
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    files = tmp_path / "jsonl"
    files.mkdir()
    (files / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    counts = []
    for source in (saved, files):
        c = cfg(tmp_path / source.name, {"tokenizer": str(tokenizer_json),
                                         "hf_dataset": str(source)})
        check_data(c)
        bundle = build_data(c)
        x, y = next(bundle.train)
        assert x.shape == (4, 32) and int(x.max()) < 400
        counts.append(prepare(c)["tokens"])
        assert train_from_config(c, plot=False).steps == 3
    assert counts[0] == counts[1]  # the same rows, whichever way they are stored


def test_null_and_empty_rows_are_skipped_and_a_non_text_column_is_refused(tmp_path, tokenizer_json,
                                                                 corpus_text, monkeypatch, caplog):
    """A null row was tokenized as the word "None"; a list as its repr."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [{"text": corpus_text[i:i + 3000]} for i in range(0, 30_000, 3000)]
    plain, nulls = tmp_path / "plain", tmp_path / "nulls"
    datasets.Dataset.from_list(rows).save_to_disk(str(plain))
    datasets.Dataset.from_list(rows + [{"text": None}] * 3 + [{"text": ""}] * 2).save_to_disk(
        str(nulls))  # an empty row was a lone end-of-text token
    tokens = []
    for source in (plain, nulls):
        with caplog.at_level(logging.WARNING, logger="speedtronic.data"):
            tokens.append(prepare(cfg(tmp_path / source.name, {
                "tokenizer": str(tokenizer_json), "hf_dataset": str(source)}))["tokens"])
    assert tokens[0] == tokens[1] and "5 row(s)" in caplog.text
    lists = tmp_path / "lists"
    datasets.Dataset.from_list([{"text": ["a", "b"]}] * 4).save_to_disk(str(lists))
    with pytest.raises(ConfigError, match=r"data.text_field: .* row 0 holds a list, not text"):
        prepare(cfg(tmp_path / "l", {"tokenizer": str(tokenizer_json),
                                     "hf_dataset": str(lists)}))


def test_a_saved_dataset_refuses_a_split_or_config_it_does_not_have(tmp_path, tokenizer_json,
                                                                    monkeypatch):
    """hf_split and hf_config were ignored for a save_to_disk copy of one Dataset: asking for
    'validation' tokenized the saved train rows (and the log said [validation])."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [{"text": f"row {i} of the set"} for i in range(20)]
    split = datasets.DatasetDict({
        "train": datasets.Dataset.from_list(rows, split="train"),
        "validation": datasets.Dataset.from_list(rows[:5], split="validation")})
    split.save_to_disk(str(tmp_path / "dict"))
    one = tmp_path / "dict" / "validation"  # one saved Dataset of the validation split

    def run(**data):
        return prepare(cfg(tmp_path / str(len(data)), {"tokenizer": str(tokenizer_json),
                                                       "hf_dataset": str(one), **data}))

    with pytest.raises(ConfigError, match=r"data.hf_split: .* of the 'validation' split, not "
                                          r"'test'"):
        run(hf_split="test")
    with pytest.raises(ConfigError, match="data.hf_config: .* no configurations"):
        run(hf_split="validation", hf_config="other")
    assert run(hf_split="validation")["tokens"] > 0


def test_a_local_dataset_without_rows_is_named_not_a_library_traceback(tmp_path, tokenizer_json,
                                                                        monkeypatch):
    """An empty save_to_disk copy failed with "list index out of range" and an empty jsonl with
    "StopIteration": the datasets library's own failures, which named no cause."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [{"text": f"row {i} of the set"} for i in range(20)]
    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "validation": datasets.Dataset.from_dict({"text": []})}).save_to_disk(
        str(tmp_path / "dict"))
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with gzip.open(tmp_path / "empty.jsonl.gz", "wb"):
        pass
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.jsonl").write_bytes(b"")
    cases = {"saved": "the saved Dataset holds no rows",
             "dict": "its saved split 'validation' holds no rows",
             "empty.jsonl": "the file holds no rows",
             "empty.jsonl.gz": "the file holds no rows",
             "folder": "a.jsonl holds no rows"}
    for name, message in cases.items():
        c = cfg(tmp_path / f"run-{name}", {"tokenizer": str(tokenizer_json),
                                           "hf_dataset": str(tmp_path / name)})
        with pytest.raises(ConfigError, match=r"cannot load .*: " + message) as caught:
            prepare(c)
        assert "which the datasets library fails on" in str(caught.value), name


def test_a_local_folder_of_files_may_be_named_from_home(tmp_path, tokenizer_json, monkeypatch):
    """``~/corpus`` worked for a save_to_disk copy, not for a folder of jsonl files (the Hub
    was asked for it)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "train.jsonl").write_text(
        "\n".join(json.dumps({"text": f"line {i} of text"}) for i in range(30)) + "\n")
    c = cfg(tmp_path / "run", {"tokenizer": str(tokenizer_json), "hf_dataset": "~/corpus"})
    assert prepare(c)["tokens"] > 0


def test_one_local_data_file_is_a_dataset_and_a_missing_path_is_named(tmp_path, tokenizer_json,
                                                                       monkeypatch):
    """A lone ``train.jsonl`` was sent to the Hub ("Couldn't reach ... on the Hub"), and so was a
    typo'd ``./path``: neither said what was wrong."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [{"text": f"row {i} of the text, with words", "n": i} for i in range(40)]
    folder = tmp_path / "folder"
    folder.mkdir()
    jsonl = folder / "train.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "train.csv").write_text(
        "n,text\n" + "".join(f'{r["n"]},"{r["text"]}"\n' for r in rows))
    (tmp_path / "train.jsonl.gz").write_bytes(gzip.compress(jsonl.read_bytes()))

    def run(source, **data):
        return prepare(cfg(tmp_path / f"run{len(str(source))}{len(data)}", {
            "tokenizer": str(tokenizer_json), "hf_dataset": str(source), **data}))["tokens"]

    tokens = run(folder)
    assert tokens > 0
    bracketed = tmp_path / "train[1].jsonl"  # data_files is a glob: this matched nothing
    bracketed.write_bytes(jsonl.read_bytes())
    for one in (jsonl, tmp_path / "train.csv", tmp_path / "train.jsonl.gz", bracketed):
        assert run(one) == tokens  # the same rows however they are stored
    if importlib.util.find_spec("zstandard") is None:  # "Compression type zstd not supported"
        (tmp_path / "train.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
        with pytest.raises(ConfigError, match="needs the 'zstandard' package: pip install"):
            run(tmp_path / "train.jsonl.zst")
    with pytest.raises(ConfigError, match=r"data.hf_split: .* one data file, read as the "
                                          r"'train' split, not 'validation'"):
        run(jsonl, hf_split="validation")
    with pytest.raises(ConfigError, match="data.hf_config: .* no configurations"):
        run(jsonl, hf_config="en")
    (tmp_path / "notes.txt").write_text("plain text\n")
    with pytest.raises(ConfigError, match=r"notes.txt.* plain text: set data.text_path"):
        run(tmp_path / "notes.txt")
    (tmp_path / "notes.xml").write_text("<a/>")
    with pytest.raises(ConfigError, match=r"data.hf_dataset: .*notes.xml.* not a data file .*"
                                          r"\.jsonl"):
        run(tmp_path / "notes.xml")
    for missing in (str(tmp_path / "nope"), "./nope/train.jsonl", "corpus/train.parquet",
                    "C:\\data\\nope", ".\\nope"):
        with pytest.raises(ConfigError, match="data.hf_dataset: no such file or folder"):
            run(missing)


def test_resume_is_exact_on_prepared_shards(tmp_path, tokenizer_json, text_dir):
    c = cfg(tmp_path, {"tokenizer": str(tokenizer_json), "text_path": str(text_dir)})
    check_data(c)
    first = build_data(c)
    for _ in range(5):
        next(first.train)
    state = first.train.state_dict()
    expected = [next(first.train) for _ in range(4)]
    again = build_data(c)
    again.train.load_state_dict(state)
    for (xa, ya), (xb, yb) in zip(expected, [next(again.train) for _ in range(4)], strict=True):
        assert (xa == xb).all() and (ya == yb).all()


@pytest.mark.parametrize("case, message", [
    ("missing_tokenizer", "data.tokenizer: file not found"),
    ("broken_tokenizer", "data.tokenizer: cannot load"),
    ("missing_field", "data.text_field: 'body' is not a column"),
    ("missing_text", "data.text_path: no such file or directory"),
    ("empty_text", "produced no tokens"),
    ("no_source", "data.tokenizer: needs a text source"),
    ("tokenizer_folder", "holds no tokenizer.json"),
    ("prepare_dir_is_a_file", "data.prepare_dir: cannot create"),
])
def test_bad_inputs_exit_2_with_one_line(tmp_path, tokenizer_json, case, message, capsys):
    data: dict = {"tokenizer": str(tokenizer_json), "text_path": str(tmp_path)}
    if case == "missing_tokenizer":
        data["tokenizer"] = str(tmp_path / "nope" / "tokenizer.json")
    elif case == "broken_tokenizer":
        bad = tmp_path / "bad.json"
        bad.write_text("{not a tokenizer")
        data["tokenizer"] = str(bad)
    elif case == "missing_field":
        saved = tmp_path / "ds"
        datasets.Dataset.from_list([{"text": "a b c"}]).save_to_disk(str(saved))
        data = {"tokenizer": str(tokenizer_json), "hf_dataset": str(saved), "text_field": "body"}
    elif case == "missing_text":
        data["text_path"] = str(tmp_path / "absent")
    elif case == "empty_text":
        (tmp_path / "empty.txt").write_text("")
        data["text_path"] = str(tmp_path / "empty.txt")
    elif case == "no_source":
        data = {"tokenizer": str(tokenizer_json)}
    elif case == "tokenizer_folder":
        (tmp_path / "tok").mkdir()
        data["tokenizer"] = str(tmp_path / "tok")
    elif case == "prepare_dir_is_a_file":
        (tmp_path / "text.txt").write_text("some text to tokenize\n")
        (tmp_path / "afile").write_text("")
        data.update(text_path=str(tmp_path / "text.txt"), prepare_dir=str(tmp_path / "afile"))
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"model": MODEL, "data": {"prepare_workers": 1,
                                                           "prepare_dir": str(tmp_path / "p"),
                                                           **data}}))
    capsys.readouterr()  # drop what the setup printed (the datasets progress bar)
    assert main(["prepare", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not list(tmp_path.glob("p/*.tmp-*"))  # a failed prepare leaves no temp folder


def test_prepare_command_reports_what_it_wrote(tmp_path, tokenizer_json, text_dir, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"data": {"tokenizer": str(tokenizer_json),
                                           "text_path": str(text_dir), "prepare_workers": 1,
                                           "prepare_dir": str(tmp_path / "p")}}))
    assert main(["prepare", "--config", str(config)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("prepared: ") and "vocab 400" in last


@pytest.fixture(scope="module")
def narrow_tokenizer_json(tmp_path_factory) -> Path:
    """A BPE that knows only ASCII letters and whose unknown token is not in its vocabulary:
    encoding 'café' raises a plain ``Exception`` inside the tokenizers library."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on the mat"] * 20,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<|endoftext|>"]))
    path = tmp_path_factory.mktemp("narrow") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.mark.parametrize("workers", [1, 2])
def test_a_tokenizer_that_fails_on_the_text_is_one_line_exit_2(tmp_path, narrow_tokenizer_json,
                                                                workers, capsys):
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("the cat sat on the mat\n" * 50)
    (texts / "b.txt").write_text("the cat sat at the café\n")
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"data": {"tokenizer": str(narrow_tokenizer_json),
                                           "text_path": str(texts),
                                           "prepare_dir": str(tmp_path / "p")}}))
    assert main(["prepare", "--config", str(config), "--workers", str(workers)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"speedtronic: error: data.tokenizer: {str(narrow_tokenizer_json)!r} "
                          f"failed to encode data.text_path file {str(texts / 'b.txt')!r}: ")
    assert "[UNK]" in err
    assert not list((tmp_path / "p").iterdir())  # no temp folder left, no shards either


def test_prepare_workers_must_be_a_positive_integer(tmp_path, tokenizer_json, text_dir, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"data": {"tokenizer": str(tokenizer_json),
                                           "text_path": str(text_dir),
                                           "prepare_dir": str(tmp_path / "p")}}))
    for bad in ("-2", "0", "two"):
        with pytest.raises(SystemExit) as info:
            main(["prepare", "--config", str(config), "--workers", bad])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --workers: must be a positive integer (tokenizer processes), got " \
               f"'{bad}'" in err and "Traceback" not in err
    with pytest.raises(ConfigError, match="workers must be a positive integer"):
        prepare(cfg(tmp_path, {"tokenizer": str(tokenizer_json), "text_path": str(text_dir)}),
                workers=0)
    assert not (tmp_path / "p").exists()  # refused before anything was written


def test_a_local_hf_dataset_folder_is_keyed_by_its_files(tmp_path, tokenizer_json, corpus_text,
                                                         monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    files = tmp_path / "jsonl"
    files.mkdir()
    rows = [{"text": corpus_text[i:i + 3000]} for i in range(0, 30_000, 3000)]
    (files / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    c = cfg(tmp_path, {"tokenizer": str(tokenizer_json), "hf_dataset": str(files)})
    first = prepare(c)
    (files / ".notes").write_text("hidden files are not data\n")
    assert prepare(c)["key"] == first["key"]
    (files / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:4]) + "\n")
    second = prepare(c)
    assert second["key"] != first["key"] and second["tokens"] < first["tokens"]
    # A Hub name is keyed by name, config, split and field only (and how empty rows are read).
    hub = cfg(tmp_path, {"tokenizer": str(tokenizer_json), "hf_dataset": "someone/corpus"})
    assert _source_fingerprint(hub) == {"hf_dataset": "someone/corpus", "config": None,
                                        "split": "train", "text_field": "text",
                                        "empty_rows": "skipped"}


def test_non_utf8_bytes_are_counted_and_warned_about(tmp_path, tokenizer_json, caplog):
    """They were replaced by U+FFFD without a word."""
    d = tmp_path / "latin1"
    d.mkdir()
    (d / "a.txt").write_bytes("café crème brûlée\n".encode("latin-1") * 10)
    with caplog.at_level(logging.WARNING, "speedtronic"):
        prepare(cfg(tmp_path, {"tokenizer": str(tokenizer_json), "text_path": str(d)}))
    assert "is not valid UTF-8: 40 byte(s) were replaced by U+FFFD" in caplog.text
    assert "a.txt" in caplog.text


def test_a_line_without_cut_points_is_cut_to_bound_memory(tmp_path, tokenizer_json, caplog,
                                                          monkeypatch):
    """A 40 MB line of minified JSON was one tokenizer call (7.6 GB peak); now no call sees
    more than 8 blocks of text, with one warning per file."""
    from speedtronic.data import prepare_shards, prepare_sources

    monkeypatch.setattr(prepare_sources, "_TEXT_BLOCK", 4096)
    d = tmp_path / "minified"
    d.mkdir()
    (d / "blob.json").write_text('{"k":"' + "abcdefghij" * 30_000 + '"}')  # 300 KB, 1 line
    (d / "normal.txt").write_text("plain words here\n" * 2000)
    calls: list[int] = []
    encode = prepare_shards._encode
    monkeypatch.setattr(prepare_shards, "_encode",
                        lambda task: (calls.append(len(task[1])), encode(task))[1])
    with caplog.at_level(logging.WARNING, "speedtronic"):
        meta = prepare(cfg(tmp_path, {"tokenizer": str(tokenizer_json), "text_path": str(d)}))
    assert max(calls) <= 9 * 4096 and meta["tokens"] > 0
    lines = [r.getMessage() for r in caplog.records if "without a newline" in r.getMessage()]
    assert len(lines) == 1 and "blob.json" in lines[0]


def test_validate_lists_a_text_folder_recursively_as_prepare_does(tmp_path, tokenizer_json,
                                                                   text_dir, capsys):
    """It listed one level only: a corpus in sub-folders "matched no files"."""
    from speedtronic.cli import main

    nested = tmp_path / "nested" / "a" / "b"
    nested.mkdir(parents=True)
    for f in text_dir.iterdir():
        (nested / f.name).write_text(f.read_text())
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"model": MODEL, "data": {
        "tokenizer": str(tokenizer_json), "text_path": str(tmp_path / "nested")}}))
    assert main(["validate", "--config", str(config)]) == 0
    assert "data: 3 text file(s) readable, tokenizer loads" in capsys.readouterr().err


def test_a_llama3_style_end_of_text_is_found_and_none_at_all_is_a_warning(tmp_path, caplog):
    """Llama 3's tokenizers end a document with <|end_of_text|>: not recognised, documents were
    joined with no separator (meta.json eos_id null) without a word."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from speedtronic.data.prepare import eos_id

    def trained(specials: list[str]) -> Tokenizer:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.train_from_iterator(["some text to learn from"] * 10, trainers.BpeTrainer(
            vocab_size=300, special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        return tok

    llama3 = trained(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"])
    assert eos_id(llama3) == llama3.token_to_id("<|end_of_text|>")
    bare = trained([])
    path = tmp_path / "bare.json"
    bare.save(str(path))
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("some text to learn from\n" * 200)
    with caplog.at_level(logging.WARNING, logger="speedtronic.data"):
        meta = prepare(cfg(tmp_path, {"tokenizer": str(path), "text_path": str(texts)}),
                       workers=1)
    assert meta["eos_id"] is None
    assert any("none of the end-of-text tokens" in r.getMessage() for r in caplog.records)


def test_a_normalizer_that_prepends_to_every_call_is_named_when_files_are_cut(
        tmp_path, caplog, monkeypatch, tokenizer_json):
    """Llama 2 / Mistral tokenizer.json files Prepend('▁') in their normalizer: each ~1 MiB
    block then starts with an extra piece (one token per block against the whole file), which
    the docs' "ids equal those of the whole file" did not cover. Said once, not hidden."""
    from tokenizers import Tokenizer, models, normalizers, trainers

    from speedtronic.data import prepare as prepare_module
    from speedtronic.data import prepare_sources

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.train_from_iterator(["some text to learn from"] * 10, trainers.BpeTrainer(
        vocab_size=60, special_tokens=["<unk>", "</s>"]))
    tok.save(str(tmp_path / "llama2.json"))
    assert prepare_module._prepends(tok)
    assert not prepare_module._prepends(Tokenizer.from_file(str(tokenizer_json)))
    monkeypatch.setattr(prepare_sources, "_TEXT_BLOCK", 1000)  # a small file is cut too
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("some text to learn from\n" * 200)
    with caplog.at_level(logging.WARNING, logger="speedtronic.data"):
        prepare(cfg(tmp_path, {"tokenizer": str(tmp_path / "llama2.json"),
                               "text_path": str(texts)}), workers=1)
    assert any("prepends to every call" in r.getMessage() for r in caplog.records)


def test_a_hub_tokenizer_id_with_an_owner_goes_to_the_hub_and_paths_do_not(tmp_path, monkeypatch,
                                                                           tokenizer_json):
    """``owner/name`` is how most Hub tokenizers are named; ``os.sep in spec`` sent every one of
    them to "file not found" on Linux and macOS. What can only be a path never reaches the Hub."""
    from tokenizers import Tokenizer

    from speedtronic.data.prepare import load_tokenizer

    asked: list[str] = []

    def from_pretrained(name: str, *args, **kwargs):
        asked.append(name)
        if name == "owner/missing":
            raise RuntimeError("Repository Not Found for url: https://huggingface.co/...")
        return Tokenizer.from_file(str(tokenizer_json))

    monkeypatch.setattr(Tokenizer, "from_pretrained", staticmethod(from_pretrained))
    assert load_tokenizer("openai-community/gpt2").get_vocab_size() == 400
    assert load_tokenizer("gpt2").get_vocab_size() == 400
    assert asked == ["openai-community/gpt2", "gpt2"]
    monkeypatch.chdir(tmp_path)
    for path in ("tok/a/tokenizer.json", "tokenizers/a/b", "./tok", "../tok", "/abs/tok",
                 "~/tok", "C:\\tok", "tok\\a", "mine.json"):
        with pytest.raises(ConfigError, match="data.tokenizer: file not found"):
            load_tokenizer(path)
    assert asked == ["openai-community/gpt2", "gpt2"]
    with pytest.raises(ConfigError, match="no local file or folder of that name, and the Hub "
                                          "gave: Repository Not Found"):
        load_tokenizer("owner/missing")
