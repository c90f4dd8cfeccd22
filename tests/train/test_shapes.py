"""Shape-alignment report: alignment choice, expected rows, batch rule, no side effects."""

from __future__ import annotations

import copy
import itertools
import logging

import pytest
import torch
from torch import nn

from speedtronic.config import load_config
from speedtronic.models import build_model
from speedtronic.train.shapes import _batch_suggestion, check_shapes, resolve_alignment

H100 = (9, 0)


class Crafted(nn.Module):
    """Known dims: vocab 250 (tied), d 100, hidden 64, conv 3->20, a custom metadata dim."""

    vocab_size = 250

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(250, 100)
        self.block = nn.ModuleList([nn.Linear(100, 64), nn.Linear(100, 64)])
        self.proj = nn.Linear(64, 100)
        self.conv = nn.Conv2d(3, 20, kernel_size=3)
        self.head = nn.Linear(100, 250, bias=False)
        self.head.weight = self.embed.weight

    def speedtronic_shape_metadata(self) -> dict:
        return {"adapter_rank": 12, "n_layer": 3, "bad": "x"}


def _cfg(micro: int = 16, target: int | None = None, block: int = 64, **sv: object):
    return load_config({"model": {"max_seq_len": 128},
                        "data": {"micro_batch_size": micro, "target_batch_size": target or micro,
                                 "block_size": block},
                        "shape_validation": sv})


def _rows(report) -> dict[tuple[str, int], object]:
    return {(r.kind, r.value): r for r in report.rows}


@pytest.mark.parametrize("device, dtype, cap, sv, expected", [
    ("cuda", torch.bfloat16, (9, 0), {}, 64),
    ("cuda", torch.float16, (8, 0), {}, 64),
    ("cuda", torch.bfloat16, (7, 5), {}, 8),
    ("cuda", torch.float32, (9, 0), {}, 4),
    ("cuda", "bf16", (9, 0), {"alignment": 16}, 16),
    ("cuda", torch.bfloat16, (9, 0), {"alignment": "none"}, None),
    ("cuda", torch.bfloat16, (9, 0), {"enabled": False}, None),
    ("cpu", torch.float32, None, {}, None),
    ("cpu", torch.float32, None, {"alignment": 16}, None),  # CPU still needs the opt-in
    ("cpu", torch.float32, None, {"warn_on_cpu": True}, 4),
    ("cpu", torch.bfloat16, None, {"warn_on_cpu": True}, 8),
])
def test_alignment_resolution(device, dtype, cap, sv, expected) -> None:
    alignment, reason = resolve_alignment(_cfg(**sv).shape_validation, device, dtype, cap)
    assert alignment == expected and reason


def test_crafted_model_rows_at_8() -> None:
    model = Crafted()
    report = check_shapes(model, _cfg(alignment=8), "cuda", torch.bfloat16, capability=H100)
    rows = _rows(report)
    assert report.alignment == 8
    # d=100 appears as embedding dim and as Linear in/out features; hidden 64 and vocab
    # 250 -> 256 (one row for the tied embedding + head, counted once in extra params).
    assert set(rows) == {("embedding", 100), ("linear", 100), ("vocab", 250), ("conv", 3),
                         ("conv", 20), ("custom", 12)}
    vocab = rows[("vocab", 250)]
    assert vocab.padded == 256 and vocab.count == 2 and vocab.extra_params == 6 * 100
    assert set(vocab.where) == {"embed.num_embeddings", "head.out_features"}
    lin = rows[("linear", 100)]
    assert lin.padded == 104 and lin.count == 4  # 2 x in_features + proj.out + head.in
    # The tied head's d is the embedding's d (one tensor axis): charged once, on the embedding.
    assert lin.extra_params == 4 * 64 * 2 + 4 * 65
    assert rows[("embedding", 100)].extra_params == 4 * 250
    assert rows[("conv", 3)].padded == 8 and rows[("conv", 3)].extra_params == 5 * 20 * 9
    assert rows[("conv", 20)].padded == 24 and rows[("conv", 20)].extra_params == 4 * 3 * 9
    assert rows[("custom", 12)].padded == 16 and rows[("custom", 12)].extra_params is None
    assert report.warning_count == len(report.rows) == 6
    table = report.format_table()
    assert table.count("\n") == 1 + 6 and "embed.num_embeddings +1 more (x2)" in table


def test_check_switches_and_vocab_flag() -> None:
    model = Crafted()
    no_vocab = check_shapes(model, _cfg(alignment=8, check_vocab=False), "cuda", "bf16",
                            capability=H100)
    assert all(r.kind != "vocab" for r in no_vocab.rows)  # head.out_features included (v2 #4)
    assert all("head.out_features" not in r.where for r in no_vocab.rows)
    no_model = check_shapes(model, _cfg(alignment=8, check_model=False), "cuda", "bf16",
                            capability=H100)
    assert {r.kind for r in no_model.rows} == {"vocab"}


def test_alignment_none_prints_nothing(caplog) -> None:
    cfg = _cfg(micro=12, target=24, block=101, alignment="none")
    with caplog.at_level(logging.DEBUG, logger="speedtronic"):
        report = check_shapes(Crafted(), cfg, "cuda", torch.bfloat16, capability=H100)
    assert report.alignment is None and report.rows == [] and report.warning_count == 0
    assert report.format_table() == "" and caplog.text == ""
    cpu = check_shapes(Crafted(), _cfg(), "cpu", torch.float32)
    assert cpu.format_table() == "" and cpu.warning_count == 0


def test_reference_engine_batch_example_never_breaks_the_batch_rule() -> None:
    # The v2.0 engine's case: target 24, micro 12, A = 8 suggested micro 16 (does not divide 24).
    cfg = _cfg(micro=12, target=24, block=101, alignment=8)
    report = check_shapes(nn.Linear(8, 8), cfg, "cuda", torch.bfloat16, capability=H100)
    tokens = _rows(report)[("tokens", 12 * 101)]
    assert "micro_batch_size=8 " in tokens.note and tokens.note.endswith(f"{8 * 101} tokens")
    assert tokens.padded is None
    assert _rows(report)[("sequence", 101)].padded == 104


def test_batch_suggestions_always_divide_target() -> None:
    for target, a, seq in itertools.product((1, 6, 24, 30, 64), (4, 8, 64), (7, 64, 101)):
        for micro in (m for m in range(1, target + 1) if target % m == 0):
            if (micro * seq) % a == 0:
                continue
            padded, note = _batch_suggestion(micro, target, seq, 128, a)
            if "micro_batch_size=" in note:
                new_micro = int(note.split("micro_batch_size=")[1].split()[0])
                assert target % new_micro == 0 and (new_micro * seq) % a == 0
                assert padded == new_micro * seq
            elif "block_size=" in note:
                t = int(note.split("block_size=")[1].split()[0])
                assert t <= 128 and (micro * t) % a == 0 and padded == micro * t
            else:
                assert padded is None


def test_reference_model_default_is_clean_and_head_dim_uses_eight() -> None:
    cfg = load_config({})
    model = build_model(cfg.model)
    report = check_shapes(model, cfg, "cuda", torch.bfloat16, capability=H100)
    assert report.alignment == 64 and report.rows == []
    assert "all checked dimensions are aligned" in report.format_table()
    odd = load_config({"model": {"d_model": 96, "n_head": 4, "vocab_size": 250, "d_ff": 256}})
    rows = _rows(check_shapes(build_model(odd.model), odd, "cuda", "bf16", capability=H100))
    assert ("head_dim", 24) not in rows  # 24 is a multiple of min(64, 8)
    assert rows[("linear", 96)].padded == 128 and rows[("vocab", 250)].padded == 256
    # Counts from the model's metadata (n_layer, n_head, ...) are never reported as dims.
    assert all(r.kind != "custom" for r in rows.values())
    odd_head = load_config({"model": {"d_model": 200, "n_head": 4, "d_ff": 512}})
    head = _rows(check_shapes(build_model(odd_head.model), odd_head, "cuda", "bf16",
                              capability=H100))[("head_dim", 50)]
    # 50 -> 56: q, k, v, o each gain 4 heads x 6 x 200 parameters, in each of 4 layers.
    assert head.padded == 56 and head.extra_params == 4 * (4 * 4 * 6 * 200)


def test_check_never_changes_model_or_config() -> None:
    model = Crafted()
    cfg = _cfg(micro=12, target=24, block=101, alignment=64)
    state = copy.deepcopy(model.state_dict())
    before = cfg.to_dict()
    report = check_shapes(model, cfg, "cuda", torch.bfloat16, capability=H100)
    assert report.warning_count > 0
    assert cfg.to_dict() == before
    after = model.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)
    assert report.as_dict()["warning_count"] == report.warning_count


def test_broken_metadata_is_ignored_with_a_warning(caplog) -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def speedtronic_shape_metadata(self) -> dict:
            raise RuntimeError("oops")

    with caplog.at_level(logging.WARNING, logger="speedtronic.shapes"):
        report = check_shapes(Broken(), _cfg(alignment=8), "cuda", "bf16", capability=H100)
    assert report.rows == [] and "oops" in caplog.text
    with caplog.at_level(logging.WARNING, logger="speedtronic.shapes"):
        check_shapes(Crafted(), _cfg(alignment=8), "cuda", "bf16", capability=H100)
    assert "'bad'" in caplog.text


def test_head_dim_row_names_the_d_model_that_aligns_both() -> None:
    from speedtronic.models import build_model

    cfg = load_config({"model": {"d_model": 100, "n_head": 2, "n_kv_head": 2, "n_layer": 1,
                                 "max_seq_len": 64, "vocab_size": 256},
                       "data": {"micro_batch_size": 8, "block_size": 64},
                       "shape_validation": {"alignment": 8}})
    report = check_shapes(build_model(cfg.model), cfg, "cuda", torch.bfloat16, capability=H100)
    head = _rows(report)[("head_dim", 50)]
    assert head.padded == 56  # alone it would ask for 56, i.e. d_model 112 at n_head 2
    assert "model.d_model=112 " in head.note  # 104 (d_model alone) would leave head_dim 52


class WideMlp(nn.Module):
    """An MLP whose hidden width (200) equals the vocab size, before an untied head."""

    vocab_size = 200

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(200, 64)
        self.up = nn.Linear(64, 200, bias=False)
        self.down = nn.Linear(200, 64, bias=False)
        self.head = nn.Linear(64, 200, bias=False)


def test_an_mlp_as_wide_as_the_vocab_is_a_model_dim_not_the_vocab() -> None:
    report = check_shapes(WideMlp(), _cfg(alignment=128), "cuda", "bf16", capability=H100)
    rows = _rows(report)
    assert set(rows[("vocab", 200)].where) == {"embed.num_embeddings", "head.out_features"}
    assert set(rows[("linear", 200)].where) == {"up.out_features", "down.in_features"}
    no_vocab = check_shapes(WideMlp(), _cfg(alignment=128, check_vocab=False), "cuda", "bf16",
                            capability=H100)
    assert set(_rows(no_vocab)[("linear", 200)].where) == {"up.out_features", "down.in_features"}


def test_every_head_of_a_multi_token_model_is_vocab() -> None:
    model = WideMlp()
    model.up, model.down = nn.Linear(64, 96, bias=False), nn.Linear(96, 64, bias=False)
    model.head2 = nn.Linear(64, 200, bias=False)  # a second (multi-token prediction) head
    rows = _rows(check_shapes(model, _cfg(alignment=128), "cuda", "bf16", capability=H100))
    assert set(rows[("vocab", 200)].where) == {"embed.num_embeddings", "head.out_features",
                                              "head2.out_features"}
