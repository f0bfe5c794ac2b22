"""What dies in a garbage collection that starts inside one of the runtime's critical
sections: its finalizers must not wait on the lock the collecting thread holds."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from slcompile.runtime import finalizing, ops, runtime_stats
from slcompile.runtime.activations import ActivationStash
from slcompile.runtime.stats import RECORDER


def test_when_safe_calls_at_once_outside_a_collection_and_on_another_thread_inside_one():
    called_on = []

    class Dying:
        def __del__(self):
            finalizing.when_safe(lambda: called_on.append(threading.get_ident()))

    Dying()
    assert called_on == [threading.get_ident()]
    gc.disable()
    try:
        ring = [Dying()]
        ring.append(ring)
        del ring
        gc.collect()
    finally:
        gc.enable()
    assert finalizing.settle(30)
    assert len(called_on) == 2 and called_on[1] != threading.get_ident()


_LOCKS = {
    "arena": lambda engine: engine.arena.space._lock,
    "page_buffers": lambda engine: engine._ledger.buffers._lock,
    "recorder": lambda engine: RECORDER._lock,
}


@pytest.mark.parametrize("tier, held", [("nvme", held) for held in _LOCKS] + [("host", "recorder")])
def test_a_token_and_a_loaded_tensor_collected_inside_a_critical_section_are_freed(global_engine, tier, held):
    """A collection can start at any allocation, also under these locks: the stored
    copy, the loaded tensor's memory and the tiers' counts are released all the same,
    and the collecting thread goes on."""
    resident = dict(runtime_stats().resident_bytes)
    stash = ActivationStash(global_engine, tier)
    x = torch.randn(300, 7)
    token = torch.ops.slc.stash(x, stash.graph_key("a"))
    torch.ops.slc.wait(token, [x])
    loaded = torch.ops.slc.unstash_wait(torch.ops.slc.unstash(token), x.shape, x.dtype, x.device)
    kept = torch.ops.slc.stash(x, stash.graph_key("b"))  # never loaded: its copy goes with its token
    torch.ops.slc.wait(kept, [x])
    # An nvme copy went with its load (`slc::unstash` is a stash's last use).
    assert torch.equal(loaded, x) and len(global_engine.keys()) == (1 if tier == "nvme" else 2)
    lock = _LOCKS[held](global_engine)

    def collect_inside():
        with lock:
            gc.collect()

    gc.disable()  # the tensors die in the collection below, not in one of their own
    try:
        ring = [token, kept, loaded]
        ring.append(ring)
        del token, kept, loaded, ring
        collector = threading.Thread(target=collect_inside, daemon=True)
        collector.start()
        collector.join(30)
    finally:
        gc.enable()
    assert not collector.is_alive(), f"a finalizer waited on the {held} lock, held by its own thread"
    assert finalizing.settle(30)
    assert global_engine.keys() == []
    assert ops.pending_tokens() == 0
    assert dict(runtime_stats().resident_bytes) == resident
