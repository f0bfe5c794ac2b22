"""Tiers, transfer kinds, devices, and the host pool's allocation logic."""

from __future__ import annotations

import pytest
import torch

from slcompile.runtime import (
    HostPool,
    Tier,
    TransferKind,
    compute_device,
    device_for,
    host_is_device,
)
from slcompile.runtime.errors import HostPoolFullError


def test_enums_are_their_names():
    assert [tier.value for tier in Tier] == ["device", "host", "nvme"]
    assert [kind.value for kind in TransferKind] == ["weight", "activation", "gradient", "kv"]
    assert Tier("nvme") is Tier.NVME and TransferKind("kv") is TransferKind.KV


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only layout")
def test_cpu_machine_host_is_device_memory():
    assert compute_device() == torch.device("cpu")
    assert host_is_device()
    assert device_for("device") == device_for(Tier.HOST) == torch.device("cpu")


def test_nvme_has_no_torch_device():
    with pytest.raises(ValueError, match="no torch device"):
        device_for(Tier.NVME)


def test_host_pool_blocks_are_page_aligned_reused_and_bounded():
    pool = HostPool(4 * 4096, pin=False)
    first = pool.allocate(100, key="a")
    second = pool.allocate(4096 + 1, key="b")
    assert first.buffer.data_ptr() % 4096 == 0 and second.buffer.data_ptr() % 4096 == 0
    assert pool.used_bytes == 3 * 4096
    with pytest.raises(HostPoolFullError, match="'c'"):
        pool.allocate(2 * 4096, key="c")
    pool.release(second)
    again = pool.allocate(3 * 4096, key="c")
    assert again.buffer.numel() == 3 * 4096
