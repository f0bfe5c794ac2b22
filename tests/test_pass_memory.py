"""The memory model of a generation pass alone (`predict_pass_memory`): a pass's
lowered graph walked with sizes written by hand, so each moment's terms can be summed
here. End to end (sizes traced from a model, the peak measured while `generate`
runs) it is tested in test_generate.py."""

from slcompile.analysis.machine import MachineFacts
from slcompile.analysis.pass_memory import GenerationSizes, TracedPass, predict_pass_memory
from slcompile.inference.pass_graph import PassLayout, lower_pass
from slcompile.schedules.generation import PassRequest, generation_pass

# A CPU machine: loads from nvme read whole 4 KiB pages.
CPU = MachineFacts(device="cpu", resident_tiers=frozenset({"device", "host"}), load_granularity=4096)


def _lowered(request: PassRequest, batch: int = 4):
    """The pass graph of `request`'s schedule, its rows split evenly, one streamed
    weight for each layer that fetches."""
    size = batch // len(request.subbatches)
    parts = tuple((sb, position * size, size) for position, sb in enumerate(request.subbatches))
    return lower_pass(generation_pass(request), PassLayout.placeholders(parts, [int(f) for f in request.fetched]))


def _sizes(layer_loads, kv_tier="device"):
    return GenerationSizes(batch=4, length=6, num_subbatches=2, prefill_subbatches=2, resident=1000,
                           layer_loads=layer_loads, key_bytes=(64, 64), caps=(None, None), vocab=10,
                           kv_tier=kv_tier, machine=CPU)


def test_a_decode_pass_with_the_cache_on_the_device_peaks_where_its_terms_sum_highest():
    # Each sequence has 8 positions; the pass adds one. The whole cache is on the
    # device: 2 layers x keys and values x 4 sequences x 8 positions x 64 bytes.
    sizes = _sizes(((), ()))
    graph = _lowered(PassRequest("decode", (0, 1), fetched=(False, False), kv_moves=False, stores=True))
    traced = TracedPass(captured=400, other=300, hidden=100, steps=(700, 900), tail=100)
    memory = predict_pass_memory(graph, sizes, traced, past=8)
    # At blk1.sb1: the capture (400) and both sub-batches' hidden states (2 x 50),
    # the cache (8192) grown by the three steps before it (3 x 2 sequences x 2 x 64).
    assert (memory.moment, dict(memory.terms)) == (
        "blk1.sb1", {"parameters": 1000, "weights": 0, "hidden": 500, "kv": 8192 + 768, "step": 900})
    assert memory.peak_bytes == 11360 and memory.resident_bytes == 1000
    # A larger tail: what its forward makes before the layers, as the capture did
    # (the layers' capture is gone by then), the hidden states twice (the outputs and
    # their concatenation), the whole grown cache.
    memory = predict_pass_memory(graph, sizes, TracedPass(400, 300, 100, (700, 900), tail=700), past=8)
    assert (memory.moment, memory.peak_bytes) == ("tail", 1000 + 400 + 200 + 8192 + 1024 + 700)


def test_fetched_weights_count_as_loads_pad_them_for_the_layer_computing_and_the_next():
    # Layer 0 fetches 5000 bytes (two pages loaded), layer 1 3000 (one page).
    sizes = _sizes(((5000,), (3000,)))
    graph = _lowered(PassRequest("decode", (0, 1), fetched=(True, True), kv_moves=False, stores=True))
    memory = predict_pass_memory(graph, sizes, TracedPass(400, 300, 100, (700, 900), tail=100), past=8)
    assert (memory.moment, dict(memory.terms)) == (
        "blk0.sb1", {"parameters": 1000, "weights": 8192 + 4096, "hidden": 450, "kv": 8192 + 256, "step": 700})
    assert memory.peak_bytes == 22886 and str(memory).startswith("decode peak 22.35 KiB at blk0.sb1: parameters")


def test_the_weights_term_counts_every_layer_whose_load_was_issued_before_the_step():
    # Three layers of 5000, 3000 and 1000 bytes fetched (two pages, one, one).
    sizes = GenerationSizes(batch=4, length=6, num_subbatches=2, prefill_subbatches=2, resident=1000,
                            layer_loads=((5000,), (3000,), (1000,)), key_bytes=(64, 64, 64),
                            caps=(None, None, None), vocab=10, kv_tier="device", machine=CPU)
    traced = TracedPass(400, 300, 100, (700, 900, 800), tail=100)
    weights = {}
    for live_blocks in (1, 2, 3):
        graph = _lowered(PassRequest("decode", (0, 1), fetched=(True,) * 3, kv_moves=False, stores=True,
                                     live_blocks=live_blocks))
        weights[live_blocks] = predict_pass_memory(graph, sizes, traced, past=8).terms["weights"]
    assert weights == {1: 8192, 2: 8192 + 4096, 3: 8192 + 4096 + 4096}
