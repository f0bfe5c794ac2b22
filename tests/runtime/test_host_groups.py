"""A block's weights on a host tier that copies, as one group: stored in one range of
the pool, a visit's loads one copy into one device buffer, updated in place at fixed
addresses (`slcompile.runtime.storage.host_copier`). On a CPU machine the engine's
`separate_host` gives the host tier memory of its own, so this path runs and counts
here as it does on a GPU (without streams and pinning)."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from slcompile.passes.coalesce_transfers import coalesce_transfers
from slcompile.runtime import Tier, TransferEngine, TransferKind, runtime_stats
from slcompile.runtime.storage.host_copier import GROUP_ALIGNMENT, group_layout
from slcompile.runtime.storage.ranges import round_up
from slcompile.runtime.storage.tiers import PAGE_BYTES
from slcompile.runtime.weights import WeightStreamer, commit_weights, stage_weights, update_weights
from slcompile.vocabulary import FETCH_ISSUE, FETCH_ISSUE_MANY, FETCH_WEIGHT, FETCH_WEIGHT_MANY, WeightKey, weight_layout

WEIGHT, HOST, DEVICE = TransferKind.WEIGHT, Tier.HOST, Tier.DEVICE
# A block's weights as a Llama's: norms of odd byte sizes between matrices.
SHAPES = (((5,), torch.float32), ((6, 5), torch.float32), ((3,), torch.bfloat16), ((7, 6), torch.float32))


@pytest.fixture
def host_engine(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine's host tier copies anyway (tests/test_device_tiers.py covers it there)")
    engine = TransferEngine(offload_dir=str(tmp_path), separate_host=True)
    yield engine
    engine.close()


def _values() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).to(dtype) for shape, dtype in SHAPES]


def _moved(before: dict) -> dict:
    after = runtime_stats().cumulative.bytes_moved
    return {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}


def test_the_layout_puts_each_member_at_the_next_boundary():
    offsets, total = group_layout([20, 120, 6, 168])
    assert offsets == [0, 32, 160, 176] and total == 344
    assert all(offset % GROUP_ALIGNMENT == 0 for offset in offsets)


def test_a_stored_run_is_one_range_and_a_visit_one_buffer_in_any_order(host_engine):
    values = _values()
    keys = [f"blk0.w{i}" for i in range(len(values))]
    nbytes = sum(v.numel() * v.element_size() for v in values)
    before = dict(runtime_stats().cumulative.bytes_moved)
    host_engine.wait_many(host_engine.store_many(keys, values, HOST, WEIGHT))
    pool = host_engine.host_pool
    assert pool.used_bytes == round_up(group_layout([nbytes_of(v) for v in values])[1], PAGE_BYTES)
    assert runtime_stats().resident_bytes[HOST] == nbytes
    for backward in (False, True):  # a backward asks for a block's weights last first
        order = list(reversed(range(len(keys)))) if backward else list(range(len(keys)))
        loaded = host_engine.wait_many(host_engine.load_many([keys[i] for i in order], WEIGHT))
        assert {t.untyped_storage().data_ptr() for t in loaded} == {loaded[0].untyped_storage().data_ptr()}
        for tensor, i in zip(loaded, order):
            assert tensor.dtype == values[i].dtype and torch.equal(tensor, values[i])
            assert tensor.data_ptr() % GROUP_ALIGNMENT == 0
        assert loaded[0].untyped_storage().nbytes() == group_layout([nbytes_of(v) for v in values])[1]
    assert _moved(before) == {(WEIGHT, DEVICE, HOST): nbytes, (WEIGHT, HOST, DEVICE): 2 * nbytes}


def nbytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def test_members_apart_in_the_group_are_copied_apart_and_counted_exactly(host_engine):
    values = _values()
    keys = [f"blk0.w{i}" for i in range(len(values))]
    host_engine.wait_many(host_engine.store_many(keys, values, HOST, WEIGHT))
    before = dict(runtime_stats().cumulative.bytes_moved)
    loaded = host_engine.wait_many(host_engine.load_many([keys[0], keys[1], keys[3]], WEIGHT))
    storages = [t.untyped_storage().data_ptr() for t in loaded]
    assert storages[0] == storages[1] != storages[2]
    assert all(torch.equal(t, values[i]) for t, i in zip(loaded, (0, 1, 3)))
    assert _moved(before) == {(WEIGHT, HOST, DEVICE): sum(nbytes_of(values[i]) for i in (0, 1, 3))}


def test_overwrite_keeps_the_address_and_later_loads_read_the_new_values(host_engine):
    values = _values()
    keys = [f"blk0.w{i}" for i in range(len(values))]
    host_engine.wait_many(host_engine.store_many(keys, values, HOST, WEIGHT))
    address = host_engine._ledger.entries[keys[1]].host_block.buffer.data_ptr()
    new = torch.full_like(values[1], 3.5)
    host_engine.overwrite(keys[1], new)
    assert host_engine._ledger.entries[keys[1]].host_block.buffer.data_ptr() == address
    loaded = host_engine.wait_many(host_engine.load_many(keys, WEIGHT))
    assert torch.equal(loaded[1], new) and torch.equal(loaded[0], values[0]) and torch.equal(loaded[3], values[3])
    with pytest.raises(ValueError, match="float16 values"):
        host_engine.overwrite(keys[1], new.half())
    host_engine.wait(host_engine.store("on_nvme", values[0], Tier.NVME, WEIGHT))
    with pytest.raises(ValueError, match="rests on the nvme tier"):
        host_engine.overwrite("on_nvme", values[0])


def test_the_group_range_goes_back_with_its_last_member(host_engine):
    values = _values()
    keys = [f"blk0.w{i}" for i in range(len(values))]
    host_engine.wait_many(host_engine.store_many(keys, values, HOST, WEIGHT))
    loaded = host_engine.wait_many(host_engine.load_many(keys, WEIGHT))
    used = host_engine.host_pool.used_bytes
    for key in keys[:-1]:
        host_engine.free(key)
    assert host_engine.host_pool.used_bytes == used
    host_engine.free(keys[-1])
    assert host_engine.host_pool.used_bytes == 0
    assert runtime_stats().resident_bytes[HOST] == 0
    assert torch.equal(loaded[2], values[2])  # what was loaded is the device's own memory


def _offloaded_block(engine: TransferEngine) -> tuple[WeightStreamer, list[torch.Tensor], list[torch.Tensor], list[str]]:
    streamer = WeightStreamer(engine, "host", live_blocks=2, group_issues=True)
    params = [torch.nn.Parameter(v.clone()) for v in _values()]
    expected = [p.detach().clone() for p in params]
    members = [(streamer.stored_key_for(f"blk0_w{i}", p), p, f"layers.0.w{i}") for i, p in enumerate(params)]
    streamer.offload_block(members)
    keys = [streamer.graph_key(stored).format() for stored, _, _ in members]
    return streamer, params, expected, keys


def test_a_visit_is_one_issue_and_one_fetch_packed_one_copy_a_dtype(host_engine, monkeypatch):
    from slcompile.runtime import set_engine

    previous = set_engine(host_engine)
    try:
        streamer, params, expected, keys = _offloaded_block(host_engine)
        graph = torch.fx.Graph()
        placeholders = [graph.placeholder(f"p{i}") for i in range(len(params))]
        issues = [graph.call_function(FETCH_ISSUE, (key,)) for key in keys]
        fetched = []
        for placeholder, key, param in zip(placeholders, keys, params):
            node = graph.call_function(FETCH_WEIGHT, (placeholder, key))
            node.meta["val"] = torch.empty_like(param, device="meta")
            fetched.append(node)
        graph.output((*fetched, *issues))
        module, done = coalesce_transfers(torch.fx.GraphModule(torch.nn.Module(), graph), fetches=True)
        calls = [node.target for node in module.graph.nodes if node.op == "call_function"
                 and getattr(node.target, "namespace", None) == "slc"]
        assert calls == [FETCH_ISSUE_MANY, FETCH_WEIGHT_MANY] and done.members == 2 * len(params)
        copies = []
        real = torch.Tensor.copy_
        monkeypatch.setattr(torch.Tensor, "copy_", lambda self, *a, **k: (copies.append(self.shape), real(self, *a, **k))[1])
        before = dict(runtime_stats().cumulative.bytes_moved)
        out = module(*params)
        # The float32 weights one copy, the bfloat16 one another: one a dtype.
        assert len(copies) == len({v.dtype for v in expected}) == 2
        for got, want in zip(out[:len(params)], expected):
            assert got.dtype == want.dtype and torch.equal(got, want)
            assert got.data_ptr() % GROUP_ALIGNMENT == 0
        storages = {got.dtype: got.untyped_storage().data_ptr() for got in out[:len(params)]}
        assert all(got.untyped_storage().data_ptr() == storages[got.dtype] for got in out[:len(params)])
        assert _moved(before) == {(WEIGHT, HOST, DEVICE): sum(nbytes_of(v) for v in expected)}
        assert streamer.pending == {} and streamer.visits.loading == {}
    finally:
        set_engine(previous)


def test_an_update_of_host_weights_is_written_in_place_all_together(host_engine):
    streamer, params, expected, keys = _offloaded_block(host_engine)
    stored = [key.split("|", 1)[1].rsplit("@", 1)[0] for key in keys]
    addresses = [host_engine._ledger.entries[key].host_block.buffer.data_ptr() for key in stored]
    new = [torch.full_like(e, float(i)) for i, e in enumerate(expected)]
    staged = stage_weights(list(zip(params, new)))
    # Staged, not yet in place: a load still reads the previous values.
    assert all(torch.equal(t, e) for t, e in zip(host_engine.wait_many(host_engine.load_many(stored)), expected))
    commit_weights(staged)
    assert [host_engine._ledger.entries[key].host_block.buffer.data_ptr() for key in stored] == addresses
    assert all(torch.equal(t, n) for t, n in zip(host_engine.wait_many(host_engine.load_many(stored)), new))
    update_weights([(params[0], expected[0])])
    assert torch.equal(host_engine.wait(host_engine.load(stored[0])), expected[0])
    assert host_engine._ledger.entries[stored[0]].host_block.buffer.data_ptr() == addresses[0]
    assert sorted(host_engine.keys()) == sorted(stored)  # no staging key left


def test_a_visit_issued_before_its_weights_change_is_loaded_again_with_the_new_values(host_engine):
    streamer, params, expected, keys = _offloaded_block(host_engine)
    parsed = [WeightKey.parse(key) for key in keys]
    streamer.issue_many(parsed, keys)
    new = [torch.full_like(e, 2.0) for e in expected]
    commit_weights(stage_weights(list(zip(params, new))))
    ordered = streamer.visits.ordered(parsed)
    packed = streamer.fetch_many(ordered, [key.format() for key in ordered])
    by_key = dict(zip(keys, new))
    _assert_packed(packed, ordered, by_key)


def test_weights_issued_one_by_one_are_packed_by_copies(host_engine):
    streamer, params, expected, keys = _offloaded_block(host_engine)
    parsed = [WeightKey.parse(key) for key in keys]
    for key, graph_key in zip(parsed, keys):
        streamer.issue(key, graph_key=graph_key)
    ordered = streamer.visits.ordered(parsed)
    packed = streamer.fetch_many(ordered, [key.format() for key in ordered])
    by_key = dict(zip(keys, expected))
    _assert_packed(packed, ordered, by_key)
    assert streamer.pending == {} and streamer.queued == {}


def _assert_packed(packed, ordered, by_key) -> None:
    """Each weight of `ordered` is its value in `by_key` (by formatted key) at its
    place in the packed tensors (`weight_layout`)."""
    layout = weight_layout([(by_key[key.format()].shape, by_key[key.format()].dtype) for key in ordered])
    for key, (section, offset) in zip(ordered, layout.places):
        want = by_key[key.format()]
        assert torch.equal(packed[section][offset:offset + want.numel()].view(want.shape), want)
