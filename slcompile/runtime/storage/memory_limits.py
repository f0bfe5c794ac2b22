"""How much more memory the machine, and the container the process runs in, can give.

Where it sits: below the host pool (``slcompile.runtime.storage.tiers.HostPool``), which
checks each growth of pinned memory against it before pinning anything. Pinned
pages can be neither swapped nor reclaimed, so pinning past what is available ends
in the kernel's OOM killer, not in an error that names the option to change.

Guarantees: ``available_host_memory`` only reads files (no allocation, no CUDA). It
returns the smaller of ``MemAvailable`` (``/proc/meminfo``) and the cgroup's limit
minus its usage (cgroup v2 ``memory.max`` - ``memory.current``, else cgroup v1
``memory.limit_in_bytes`` - ``memory.usage_in_bytes``), and says which one it is. A
limit of ``max`` or a file that is absent or unreadable means that limit does not
apply; with neither, the answer is None.
"""

from __future__ import annotations

import dataclasses
import logging
import os

__all__ = ["AvailableMemory", "available_host_memory"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AvailableMemory:
    """Bytes the process may still take, and the limit that says so.

    Attributes:
        available_bytes: The bytes available now.
        source: Which limit gives them, with its files (for error messages).
    """

    available_bytes: int
    source: str


def available_host_memory(
    meminfo_path: str = "/proc/meminfo", cgroup_dir: str = "/sys/fs/cgroup"
) -> AvailableMemory | None:
    """Returns the memory this process can still take: the smaller of the machine's
    ``MemAvailable`` and its cgroup's limit minus usage.

    Args:
        meminfo_path: The ``/proc/meminfo`` to read.
        cgroup_dir: Where the cgroup filesystem is mounted: cgroup v2 files are read
            in it, cgroup v1 files in its ``memory`` directory.

    Returns:
        The smaller figure and its source, or None when neither limit applies.
    """
    limits = [limit for limit in (_meminfo_available(meminfo_path), _cgroup_available(cgroup_dir)) if limit]
    return min(limits, key=lambda limit: limit.available_bytes) if limits else None


def _meminfo_available(path: str) -> AvailableMemory | None:
    try:
        with open(path) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    kib = int(line.split()[1])  # the kernel writes "MemAvailable: <n> kB"
                    return AvailableMemory(kib * 1024, f"MemAvailable in {path}")
    except (OSError, ValueError, IndexError) as error:
        log.debug("no MemAvailable from %s: %s", path, error)
    return None


def _cgroup_available(cgroup_dir: str) -> AvailableMemory | None:
    v1_dir = os.path.join(cgroup_dir, "memory")
    for limit_path, usage_path in (
        (os.path.join(cgroup_dir, "memory.max"), os.path.join(cgroup_dir, "memory.current")),
        (os.path.join(v1_dir, "memory.limit_in_bytes"), os.path.join(v1_dir, "memory.usage_in_bytes")),
    ):
        try:
            with open(limit_path) as limit_file:
                limit = limit_file.read().strip()
            if limit == "max":
                return None
            with open(usage_path) as usage_file:
                usage = int(usage_file.read().strip())
            available = max(0, int(limit) - usage)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as error:
            log.debug("no cgroup limit from %s: %s", limit_path, error)
            return None
        return AvailableMemory(available, f"the cgroup's limit: {limit_path} minus {usage_path}")
    return None
