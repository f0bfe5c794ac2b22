"""Failing nvme writes on purpose: the arena writes on its I/O threads (`os.pwritev`)."""

from __future__ import annotations

import os
from collections.abc import Callable


def fail_writes(monkeypatch, failure: Callable[[int], int | None], before: Callable[[], None] | None = None):
    """Makes each nvme write fail as `failure(file offset)` says (an errno; None: it
    writes), `failure` called once per write in issue order; `before()` runs on the
    thread that reports a failure, just before it does."""
    real_pwritev = os.pwritev

    def pwritev(fd, buffers, offset):
        error = failure(offset)
        if error is not None:
            if before is not None:
                before()
            raise OSError(error, os.strerror(error))
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
