"""Fixtures for the runtime tests: an engine on a private temp dir, clean counters."""

from __future__ import annotations

import pytest

from slcompile.runtime import TransferEngine, reset_runtime_stats, set_engine


@pytest.fixture
def engine(tmp_path):
    """An engine whose nvme arena lives under this test's tmp dir.

    Chunks of 1 MiB so that tensors of a few MiB take the multi-chunk path.
    """
    reset_runtime_stats()
    transfer_engine = TransferEngine(offload_dir=str(tmp_path), chunk_bytes=1 << 20)
    yield transfer_engine
    transfer_engine.close()


@pytest.fixture
def global_engine(engine):
    """``engine``, installed as the process-wide engine the custom ops call."""
    previous = set_engine(engine)
    yield engine
    set_engine(previous)
