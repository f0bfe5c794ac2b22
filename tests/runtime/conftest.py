"""Fixtures for the runtime tests: the test device, an engine on a private temp dir,
clean counters."""

from __future__ import annotations

import pytest
import torch
from devices import device_under_test

from slcompile.runtime import TransferEngine, compute_device, reset_runtime_stats, set_engine


@pytest.fixture(autouse=True)
def _engine_computes_on_the_test_device():
    """The engine always computes on `compute_device()`: a CPU run on a CUDA machine
    needs CUDA hidden (`CUDA_VISIBLE_DEVICES=`), not only `SLC_TEST_DEVICE=cpu`."""
    if device_under_test().type != compute_device().type:
        pytest.skip(f"the transfer engine computes on {compute_device()}, the tests on {device_under_test()}")


@pytest.fixture
def device() -> torch.device:
    """The device the tests (and the engine) compute on."""
    return device_under_test()


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
