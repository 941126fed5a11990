"""Shared fixtures: the Multi30k directory (from $DTRAIN_DATA_DIR, as in CI) and a tiny model."""

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def multi30k_dir() -> Path:
    root = os.environ.get("DTRAIN_DATA_DIR")
    if not root or not (Path(root) / "multi30k").is_dir():
        pytest.fail("DTRAIN_DATA_DIR must point at a folder holding multi30k/ (see README: Data)")
    return Path(root) / "multi30k"


@pytest.fixture
def tiny_model():
    from dtrain.model import Transformer

    torch.manual_seed(0)
    model = Transformer(vocab=50, N=2, d_model=32, d_ff=64, h=4, dropout=0.0)
    model.eval()
    return model
