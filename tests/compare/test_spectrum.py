"""Singular-value spectra (compare/spectrum.py): known values, which matrices count as hidden."""

from __future__ import annotations

import pytest
import torch
from _compare_fixtures import TINY
from torch import nn

from speedtronic.compare.spectrum import hidden_matrices, matrix_spectrum
from speedtronic.config import load_config


# ------------------------------------------------------------------------------ spectra
def test_matrix_spectrum_known_values():
    s = matrix_spectrum(torch.diag(torch.tensor([3.0, 1.0])))
    assert s["stable_rank"] == pytest.approx(10 / 9)
    assert s["top_singular_values"] == pytest.approx([3.0, 1.0])
    assert matrix_spectrum(torch.eye(5))["effective_rank"] == pytest.approx(5.0)
    assert matrix_spectrum(torch.ones(4, 3))["stable_rank"] == pytest.approx(1.0)


def test_hidden_matrices_exclude_embeddings_heads_and_vectors():
    from speedtronic.models import build_model

    model = build_model(load_config(TINY))
    names = [n for n, _ in hidden_matrices(model)]
    assert names and all(p.ndim == 2 for _, p in hidden_matrices(model))
    assert not any("embed" in n or "lm_head" in n or "norm" in n for n in names)
    assert len(hidden_matrices(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4)))) == 1
