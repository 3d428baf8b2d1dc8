"""Fixtures shared by the superchip pytest conformance suite (helpers live in helpers.py)."""

from __future__ import annotations

import gc

import pytest
import torch

import superchip

from helpers import DEVICE


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def clean_memory():
    """Frees cached blocks and resets peaks so a test can assert exact statistics deltas."""
    gc.collect()
    superchip.empty_cache()
    superchip.reset_peak_memory_stats()
    yield
    gc.collect()
    superchip.empty_cache()
