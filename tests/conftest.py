"""Shared fixtures for the unit tests."""

from __future__ import annotations

import pytest

from dflash_lab.repro import block_network, set_offline_env

# Offline before anything imports huggingface_hub (it reads these at import).
set_offline_env()


@pytest.fixture(autouse=True)
def _no_network():
    """Every test runs with only loopback connections allowed (JupyterLab, gloo)."""
    with block_network():
        yield
