"""Runtime of slcompile: memory tiers, the transfer engine, transfer custom ops,
and exact byte and timeline accounting.

Importing this package registers what the ``slc::`` ops of ``slcompile.vocabulary``
do at run time (``ops``, ``activations``, ``weights``, ``gradients``). See ``engine`` for the
transfer semantics, ``nvme`` for the O_DIRECT arena and ``stats`` for what the
counters mean.
"""

from __future__ import annotations

import logging

from . import activations, gradients, ops, runs, weights  # registers the slc:: op implementations
from .storage.engine import (
    StoredTensor,
    TransferEngine,
    TransferHandle,
    configure_engine,
    get_engine,
    normalize_key,
    set_engine,
)
from .errors import (
    CorruptDataError,
    DiskFullError,
    HostPoolFullError,
    OffloadDirError,
    OffloadError,
    ArenaClosedError,
    OffloadFileMissingError,
    ShortReadError,
    TransferFailedError,
    UnknownKeyError,
    UnsupportedTensorError,
)
from .finalizing import collect_garbage
from .storage.nvme import NvmeArena, clean_stale_dirs
from .stats import (
    RuntimeStats,
    StepStats,
    TimelineEvent,
    compute_region,
    mark_step,
    reset_runtime_stats,
    runtime_stats,
    set_timeline_enabled,
    timeline,
)
from .storage.tiers import HostPool, Tier, TransferKind, compute_device, device_for, host_is_device

__all__ = [
    "Tier",
    "TransferKind",
    "compute_device",
    "device_for",
    "host_is_device",
    "HostPool",
    "NvmeArena",
    "clean_stale_dirs",
    "collect_garbage",
    "TransferEngine",
    "TransferHandle",
    "StoredTensor",
    "normalize_key",
    "get_engine",
    "set_engine",
    "configure_engine",
    "RuntimeStats",
    "StepStats",
    "TimelineEvent",
    "runtime_stats",
    "reset_runtime_stats",
    "mark_step",
    "compute_region",
    "timeline",
    "set_timeline_enabled",
    "ops",
    "OffloadError",
    "OffloadDirError",
    "DiskFullError",
    "ShortReadError",
    "CorruptDataError",
    "OffloadFileMissingError",
    "UnsupportedTensorError",
    "UnknownKeyError",
    "HostPoolFullError",
    "TransferFailedError",
    "ArenaClosedError",
]

log = logging.getLogger(__name__)
