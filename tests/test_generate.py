"""`slcompile.generate`: the tokens of eager `model.generate`, layer-major over
sub-batches, with weights and KV cache on tiers; exact byte counts; compiles."""

from __future__ import annotations

import copy

import pytest
import torch
from devices import device_under_test
from models import hf_gpt2, hf_llama
from torch._dynamo.testing import CompileCounterWithBackend

import slcompile
from slcompile.facts import machine_facts
from slcompile.generate import explain_generation
from slcompile.runtime.storage.tiers import PAGE_BYTES, Tier, TransferKind

VOCAB = 96
PAD = 0


def _as_measured():
    """This machine's facts with a page of slack per load, as `buffers_seen_by_profiler` measures loads."""
    return machine_facts(load_overhead=PAGE_BYTES)


def hf_mistral(sliding_window: int = 4):
    """Mistral whose sliding window is shorter than the prompts."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                           sliding_window=sliding_window)
    return MistralForCausalLM(config)


def hf_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    return Qwen2ForCausalLM(config)


FAMILIES = {
    "llama": lambda: hf_llama(num_hidden_layers=2, hidden_size=32, vocab_size=VOCAB).to(device_under_test()),
    "mistral": lambda: hf_mistral().to(device_under_test()),
    "qwen2": lambda: hf_qwen2().to(device_under_test()),
    "gpt2": lambda: hf_gpt2(n_layer=2, n_embd=32, vocab_size=VOCAB, n_positions=32).to(device_under_test()),
}


def left_padded_batch(batch: int = 4, length: int = 7, seed: int = 0):
    """Prompts of different lengths, left-padded with PAD: row i has i % 3 pads."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch, length), generator=generator)
    mask = torch.ones_like(input_ids)
    for row in range(batch):
        pads = row % 3
        input_ids[row, :pads] = PAD
        mask[row, :pads] = 0
    return input_ids.to(device_under_test()), mask.to(device_under_test())


def eager_generate(model, input_ids, mask, max_new_tokens, eos):
    return model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=eos, pad_token_id=PAD)


def early_eos(model, input_ids, mask, max_new_tokens):
    """An EOS token that ends some sequences before the others: the third token
    the first sequence generates without one."""
    free = eager_generate(model, input_ids, mask, max_new_tokens, eos=[])
    return int(free[0, input_ids.shape[1] + 2])


def run_generate(model, input_ids, mask, max_new_tokens, eos, **options):
    options.setdefault("backend", "aot_eager")
    return slcompile.generate(model, input_ids, mask, max_new_tokens=max_new_tokens, eos_token_id=eos,
                              pad_token_id=PAD, progress=False, **options)


# A covering subset of family x K x kv tier (every family, both K, every tier).
CASES = [
    ("llama", 4, "host", "device"),
    ("llama", 1, "nvme", "nvme"),
    ("mistral", 4, "nvme", "device"),
    ("qwen2", 1, "device", "device"),
    ("gpt2", 4, "device", "nvme"),
]


@pytest.mark.oldest
@pytest.mark.cuda_check
@pytest.mark.parametrize("family,k,kv_cache,weights", CASES)
def test_greedy_tokens_equal_eager_generate_with_left_padding_and_early_eos(tmp_path, family, k, kv_cache, weights):
    model = FAMILIES[family]().eval()
    input_ids, mask = left_padded_batch()
    if family == "mistral":
        assert model.config.sliding_window < input_ids.shape[1]
    eos = early_eos(model, input_ids, mask, max_new_tokens=10)
    expected = eager_generate(model, input_ids, mask, 10, eos=eos)
    out = run_generate(copy.deepcopy(model), input_ids, mask, 10, eos, num_subbatches=k, kv_cache=kv_cache,
                       weights=weights, offload_dir=str(tmp_path))
    assert torch.equal(out, expected), (out, expected)
    generated = out[:, input_ids.shape[1]:]
    finished_early = [row for row in range(len(out)) if (generated[row, :-1] == eos).any()]
    assert finished_early and len(finished_early) < len(out)
    for row in finished_early:
        after = int((generated[row] == eos).nonzero()[0]) + 1
        assert (generated[row, after:] == PAD).all()


def kv_bytes(model, batch: int, length: int) -> int:
    """Bytes of the keys and values of every layer for `batch` sequences of `length`."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_layer = 2 * batch * config.num_key_value_heads * length * head_dim * 4
    return config.num_hidden_layers * per_layer


KV_STORED = (TransferKind.KV, Tier.DEVICE, Tier.NVME)
KV_LOADED = (TransferKind.KV, Tier.NVME, Tier.DEVICE)
WEIGHT_LOADED = (TransferKind.WEIGHT, Tier.NVME, Tier.DEVICE)


@pytest.mark.parametrize("k", [1, 4])
def test_nvme_kv_cache_stores_new_positions_in_merged_segments_loads_what_it_uses_and_weights_once_per_step(
        tmp_path, k):
    model = FAMILIES["llama"]().eval()
    input_ids, mask = left_padded_batch(batch=4, length=6)
    new_tokens = 8
    expected = eager_generate(model, input_ids, mask, new_tokens, eos=[])
    block_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    # Decode step t writes its new position with the segments it merges: the
    # prefill's 6, then 1, 2, 1, 4 (1 + 1 + 2), 1, 2 positions (a binary counter's carries).
    written = [6, 1, 2, 1, 4, 1, 2, 0]
    slcompile.reset_runtime_stats()
    out = run_generate(model, input_ids, mask, new_tokens, [], num_subbatches=k, weights="nvme", kv_cache="nvme",
                       offload_dir=str(tmp_path), return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert [step.phase for step in out.steps] == ["prefill"] + ["decode"] * (new_tokens - 1)
    for t, step in enumerate(out.steps):
        # Each layer's weights are loaded once per pass, for all K sub-batches.
        assert step.bytes_of(*WEIGHT_LOADED) == block_bytes
        if t == 0:
            assert step.bytes_of(*KV_STORED) == kv_bytes(model, 4, 6) and step.bytes_of(*KV_LOADED) == 0
        else:
            # A decode step loads the 6 + t - 1 positions the cache holds, whatever
            # K is; the last one stores nothing (no step reads it).
            assert step.bytes_of(*KV_STORED) == kv_bytes(model, 4, written[t])
            assert step.bytes_of(*KV_LOADED) == kv_bytes(model, 4, 6 + t - 1)
    moved = slcompile.runtime_stats().cumulative.bytes_moved
    assert moved[KV_STORED] == kv_bytes(model, 4, sum(written))
    assert moved[KV_LOADED] == sum(kv_bytes(model, 4, 6 + t) for t in range(new_tokens - 1))
    assert moved[WEIGHT_LOADED] == new_tokens * block_bytes
    # The weights stay on the tier; a later call on device weights fetches them.
    assert len(slcompile.offloaded_parameters(model)) == len(list(model.model.layers.parameters()))
    assert torch.equal(run_generate(model, input_ids, mask, new_tokens, [], num_subbatches=k), expected)


@pytest.mark.usefixtures("without_collections")
def test_each_call_makes_its_streamer_and_stash_from_plans_and_leaves_none_behind(tmp_path, monkeypatch):
    from slcompile.runtime import activations, collect_garbage, weights
    from slcompile.runtime.step import StepRuntime

    model = FAMILIES["llama"]().eval()
    input_ids, mask = left_padded_batch()
    expected = eager_generate(model, input_ids, mask, 4, eos=[])
    started, start = [], StepRuntime.start

    def recorded(runtime, *args, **kwargs):
        started.append(runtime)
        return start(runtime, *args, **kwargs)

    monkeypatch.setattr(StepRuntime, "start", recorded)
    collect_garbage()
    before = len(weights._STREAMERS), len(activations._STASHES)
    for _ in range(3):
        # Four prefill parts with the cache on nvme: the prefill's hidden states rest there too.
        out = run_generate(model, input_ids, mask, 4, [], num_subbatches=2, prefill_subbatches=4, weights="nvme",
                           kv_cache="nvme", offload_dir=str(tmp_path), return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        assert any(kind is TransferKind.ACTIVATION for kind, _, _ in out.steps[0].bytes_moved)
    assert [(runtime.streamer.tier, runtime.stash.tier) for runtime in started] == [(Tier.NVME, Tier.NVME)] * 3
    started.clear()
    del out
    assert (len(weights._STREAMERS), len(activations._STASHES)) == before


@pytest.mark.parametrize("family,prefill_k,k", [("llama", 4, 2), ("mistral", 1, 4), ("gpt2", 2, 4)])
def test_prefill_and_decode_split_the_batch_differently_with_the_same_tokens(tmp_path, family, prefill_k, k):
    model = FAMILIES[family]().eval()
    input_ids, mask = left_padded_batch()
    expected = eager_generate(model, input_ids, mask, 6, eos=[])
    out = run_generate(model, input_ids, mask, 6, [], num_subbatches=k, prefill_subbatches=prefill_k,
                       kv_cache="nvme", offload_dir=str(tmp_path), return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.steps[0].subbatches == tuple(range(prefill_k))
    assert all(step.subbatches == tuple(range(k)) for step in out.steps[1:])


def test_finished_subbatches_are_skipped_and_generation_stops_when_all_are_done(tmp_path):
    model = FAMILIES["llama"]().eval()
    input_ids, mask = left_padded_batch()
    new_tokens = 10
    # Row 0 (sub-batch 0 of four) ends after its third token, the others go on.
    eos = early_eos(model, input_ids, mask, new_tokens)
    expected = eager_generate(model, input_ids, mask, new_tokens, eos=eos)
    out = run_generate(model, input_ids, mask, new_tokens, eos, num_subbatches=4, kv_cache="nvme",
                       offload_dir=str(tmp_path), return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    generated = out.sequences[:, input_ids.shape[1]:]
    done = [int((row == eos).nonzero()[0]) if (row == eos).any() else None for row in generated]
    assert done[0] == 2 and None in done
    for t, step in enumerate(out.steps):
        # Pass t computes the token at t; a sub-batch (one row) finished before it is skipped.
        assert step.subbatches == tuple(sb for sb in range(4) if done[sb] is None or done[sb] >= t)
        assert step.bytes_of(*KV_LOADED) == (0 if t == 0 else kv_bytes(model, len(step.subbatches), 7 + t - 1))
    assert out.subbatch_steps < 4 * new_tokens
    # Every sequence ends at its first token: one pass, then the pads.
    first = eager_generate(model, input_ids, mask, 1, eos=[])[:, -1].tolist()
    expected = eager_generate(model, input_ids, mask, new_tokens, eos=first)
    out = run_generate(model, input_ids, mask, new_tokens, first, num_subbatches=2, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert len(out.steps) == 1 and out.sequences.shape[1] == input_ids.shape[1] + 1


def test_embeddings_masks_and_rotary_are_computed_once_per_pass(monkeypatch):
    from slcompile.inference import executor

    model = FAMILIES["llama"]().eval()
    input_ids, mask = left_padded_batch()
    expected = eager_generate(model, input_ids, mask, 5, eos=[])
    calls = []
    model.get_input_embeddings().register_forward_hook(lambda *args: calls.append(1))
    assert torch.equal(run_generate(model, input_ids, mask, 5, [], num_subbatches=4), expected)
    # One capture and one tail per pass, whatever K, and once per phase the capture
    # of one sub-batch alone that checks the shared one gives the same arguments.
    assert len(calls) == 2 * 5 + 2
    # Where they would differ, each sub-batch is captured alone: the same tokens.
    calls.clear()
    monkeypatch.setattr(executor, "_same_arguments", lambda *args: False)
    assert torch.equal(run_generate(model, input_ids, mask, 5, [], num_subbatches=4), expected)
    # (the first prefill and decode passes also ran the shared capture they checked)
    assert len(calls) == 2 * 4 * 5 + 2


@pytest.mark.oldest
def test_explain_generation_predicts_the_measured_schedules_and_bytes_of_every_pass(tmp_path):
    from slcompile.generate import explain_generation
    from slcompile.units import format_bytes

    # (resident tiers: the schedules keep the cache, "store_kv", but fetch and load nothing)
    for family, prefill_k, k, tier in (("llama", 1, 2, "device"), ("llama", 2, 1, "nvme"), ("mistral", 4, 2, "nvme")):
        model = FAMILIES[family]().eval()
        input_ids, mask = left_padded_batch(batch=4, length=6)
        options = dict(num_subbatches=k, prefill_subbatches=prefill_k, weights=tier, kv_cache=tier,
                       offload_dir=str(tmp_path))
        expected = eager_generate(model, input_ids, mask, 6, eos=[])
        explained = explain_generation(model, input_ids.shape, 6, **options)
        out = run_generate(model, input_ids, mask, 6, [], return_dict_in_generate=True, **options)
        assert torch.equal(out.sequences, expected)
        assert out.steps == explained.steps
    # Mistral's window of 4 keeps 3 positions: after the 6-token prefill a decode step
    # reads the prefill's last 3 (stored as one segment), then it and the new ones,
    # until the window has left it.
    loaded = [step.bytes_of(*KV_LOADED) for step in explained.steps]
    assert loaded == [kv_bytes(model, 4, n) for n in (0, 3, 4, 5, 3, 3)]
    # Four prefill sub-batches: each one's hidden states go to the KV tier between
    # the layers, and the next step's come back while a step runs; a store is waited
    # for two spills later, or once its state is loaded back.
    # Each layer's weights are fetched once, the next layer's issued before it runs;
    # each part's tail runs just after its last layer.
    assert explained.prefill_schedule.splitlines() == [
        "prefill fetch.issue blk0", "prefill fetch.wait blk0", "prefill fetch.issue blk1",
        "prefill blk0.sb0", "prefill spill.issue blk0.sb0",
        "prefill blk0.sb1", "prefill store_kv.issue blk0.sb0", "prefill spill.issue blk0.sb1",
        "prefill blk0.sb2", "prefill spill.issue blk0.sb2", "prefill spill.wait blk0.sb0",
        "prefill fill.issue blk0.sb0",
        "prefill blk0.sb3", "prefill store_kv.issue blk0.sb1", "prefill spill.issue blk0.sb3",
        "prefill spill.wait blk0.sb1",
        "prefill fetch.wait blk1", "prefill fill.issue blk0.sb1", "prefill fill.wait blk0.sb0",
        "prefill blk1.sb0", "prefill suffix.sb0", "prefill fill.issue blk0.sb2", "prefill fill.wait blk0.sb1",
        "prefill blk1.sb1", "prefill store_kv.issue blk1.sb0", "prefill suffix.sb1", "prefill fill.issue blk0.sb3",
        "prefill fill.wait blk0.sb2", "prefill spill.wait blk0.sb2",
        "prefill blk1.sb2", "prefill suffix.sb2", "prefill fill.wait blk0.sb3", "prefill spill.wait blk0.sb3",
        "prefill blk1.sb3", "prefill store_kv.issue blk1.sb1", "prefill suffix.sb3"]
    hidden = 4 * 6 * model.config.hidden_size * 4  # one layer's output, every sequence, float32
    assert explained.steps[0].bytes_of(TransferKind.ACTIVATION, Tier.DEVICE, Tier.NVME) == hidden
    assert explained.steps[0].bytes_of(TransferKind.ACTIVATION, Tier.NVME, Tier.DEVICE) == hidden
    assert not any(step.bytes_of(TransferKind.ACTIVATION, Tier.DEVICE, Tier.NVME) for step in explained.steps[1:])
    # Each (layer, sub-batch)'s cache loads while the two before it run.
    assert explained.decode_schedule.splitlines() == [
        "decode prefix", "decode fetch.issue blk0", "decode load_kv.issue blk0.sb0",
        "decode fetch.wait blk0", "decode fetch.issue blk1", "decode load_kv.issue blk0.sb1",
        "decode load_kv.issue blk1.sb0", "decode blk0.sb0", "decode store_kv.issue blk0.sb0",
        "decode load_kv.issue blk1.sb1", "decode blk0.sb1", "decode store_kv.issue blk0.sb1",
        "decode fetch.wait blk1", "decode blk1.sb0", "decode store_kv.issue blk1.sb0",
        "decode blk1.sb1", "decode store_kv.issue blk1.sb1", "decode suffix"]
    # The last pass keeps no cache: no pass reads it.
    assert "store_kv" not in explained.steps[-1].schedule.text() and not explained.steps[-1].bytes_of(*KV_STORED)
    text = str(explained)
    assert "prefill: 4 sub-batches of 1; decode: 2 sub-batches of 2" in text
    assert f"prefill hidden states between layers on nvme: {format_bytes(hidden)} stored and loaded" in text
    assert "prefill schedule: blk0.sb0-3 blk1.sb0 suffix.sb0 " in text
    assert ("(36 steps; fetch.issue 2, fetch.wait 2, spill.issue 4, store_kv.issue 4, spill.wait 4, fill.issue 4, "
            "fill.wait 4)") in text


def test_one_compile_for_the_prefill_and_one_for_every_decode_step():
    model = FAMILIES["llama"]().eval()
    input_ids, mask = left_padded_batch(batch=2, length=6)
    mask[:, 0] = 0  # every sub-batch padded: one prefill mask kind
    input_ids[:, 0] = PAD
    counter = CompileCounterWithBackend("aot_eager")
    out = run_generate(model, input_ids, mask, 20, [], num_subbatches=2, backend=counter)
    assert out.shape == (2, 26)
    assert torch.equal(out, eager_generate(model, input_ids, mask, 20, eos=[]))
    assert counter.frame_count == 2


def test_sampling_follows_the_seed_and_top_k_1_is_greedy():
    model = FAMILIES["gpt2"]().eval()
    input_ids, mask = left_padded_batch()

    def sample(seed, **options):
        generator = torch.Generator(device_under_test()).manual_seed(seed)
        return run_generate(model, input_ids, mask, 8, [], num_subbatches=2, do_sample=True, generator=generator,
                            **options)

    first, again, other = sample(1), sample(1), sample(2)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(sample(3, top_k=1), eager_generate(model, input_ids, mask, 8, eos=[]))


def test_bad_input_gets_a_clear_error():
    from models import Stack

    model = FAMILIES["llama"]().eval()
    input_ids, mask = left_padded_batch(batch=6)
    with pytest.raises(slcompile.OptionError, match=r"^generate: num_subbatches=4 does not divide the batch of 6"):
        run_generate(model, input_ids, mask, 4, [], num_subbatches=4)
    with pytest.raises(slcompile.OptionError, match=r"^generate: prefill_subbatches=4 does not .* \(1, 2, 3, 6\)"):
        run_generate(model, input_ids, mask, 4, [], num_subbatches=2, prefill_subbatches=4)
    with pytest.raises(slcompile.OptionError, match=r"max_new_tokens=60 .* over the model's 64 .* max_new_tokens <= 57"):
        run_generate(model, input_ids, mask, 60, [])
    with pytest.raises(slcompile.OptionError, match="^generate: speedloader option 'kv_cache' must be one of .* got 'disk'"):
        run_generate(model, input_ids, mask, 4, [], kv_cache="disk")
    with pytest.raises(slcompile.RefusedError, match="^Stack has no KV cache"):
        run_generate(Stack(lambda width: torch.nn.Linear(width, width)), torch.zeros(2, 3, dtype=torch.long), None, 4, [])


def test_kv_store_merges_new_positions_into_segments_and_reads_back_the_positions_the_cache_keeps(tmp_path):
    from slcompile.runtime.storage.engine import TransferEngine
    from slcompile.runtime.kv import KVStore

    engine = TransferEngine(offload_dir=str(tmp_path))
    store = KVStore(engine, "nvme")
    full = torch.randn(2, 2, 9, 4)  # (batch, heads, positions, head_dim)
    row_bytes = 2 * 2 * 4 * 4  # one position of keys (as many for values)
    slcompile.reset_runtime_stats()
    # A window that keeps 3 positions: the prefill stores its last 3, each step adds
    # one, written with the last segments not longer than the run of new positions.
    store.store(0, 0, full[:, :, 3:6], -full[:, :, 3:6], new=6)
    segments = []
    for end in (7, 8, 9):
        keys, values = store.take(0, 0)
        assert torch.equal(keys, full[:, :, end - 4:end - 1]) and torch.equal(values, -keys)
        store.store(0, 0, full[:, :, end - 3:end], -full[:, :, end - 3:end], new=1)
        segments.append(store.segments(0, 0))
    store.flush()
    # The prefill's segment is freed once no kept position is in it.
    assert segments == [(3, 1), (3, 2), (2, 1)]
    moved = slcompile.runtime_stats().cumulative.bytes_moved
    assert moved[KV_STORED] == 2 * row_bytes * (3 + 1 + 2 + 1)
    assert moved[KV_LOADED] == 2 * row_bytes * (3 + 4 + 5)
    # Keys and values of other shapes and types (heads of another size) share a row.
    store.store(1, 0, full[:, :, :5], full[:, :, :5, :3].half(), new=5)
    store.store(1, 0, full[:, :, :6], full[:, :, :6, :3].half(), new=1)
    keys, values = store.take(1, 0)
    assert torch.equal(keys, full[:, :, :6]) and torch.equal(values, full[:, :, :6, :3].half())
    # Where a row (one position's keys and values) fills whole pages, the segments
    # are read straight into their rows of one buffer.
    into = []
    load = engine.load
    engine.load = lambda *args, **kwargs: into.append(kwargs.get("into") is not None) or load(*args, **kwargs)
    wide = torch.randn(2, 2, 8, 256)  # rows of 2 * 4096 bytes
    store.store(2, 0, wide[:, :, :5], -wide[:, :, :5], new=5)
    for end in (6, 7, 8):
        store.store(2, 0, wide[:, :, :end], -wide[:, :, :end], new=1)
        keys, values = store.take(2, 0)
        assert torch.equal(keys, wide[:, :, :end]) and torch.equal(values, -keys)
    assert store.segments(2, 0) == (5, 2, 1) and into == [True] * (2 + 2 + 3)
    store.close()
    assert engine.keys() == []
    moved = dict(slcompile.runtime_stats().cumulative.bytes_moved)
    # The device tier keeps the layer's cache itself: no copy, no bytes.
    device = KVStore(engine, "device")
    device.store(0, 0, full, -full, new=1)
    assert device.take(0, 0)[0].data_ptr() == full.data_ptr() and device.segments(0, 0) == (9,)
    assert slcompile.runtime_stats().cumulative.bytes_moved == moved
    engine.close()


def measured_generate_peak(model, input_ids, new_tokens, mask=None, **options) -> int:
    """Bytes the allocator handed out at the peak of a `generate` call, over what
    it held before (the resident parameters), in steady state: compiled, weights
    already on their tier. Loads land in torch's allocator, one page of slack each."""
    from slcompile.analysis.memory import measured_peak_bytes
    from slcompile.runtime.storage.nvme import buffers_seen_by_profiler

    def run():
        run_generate(model, input_ids, mask, new_tokens, [], **options)

    with buffers_seen_by_profiler():
        run()
        return measured_peak_bytes(run)


# (prefill K, decode K, weights, kv_cache, prompt length, new tokens, hidden size):
# the prefill the peak on each tier (with 4 and 8 sub-batches and the cache on nvme,
# hidden states rest there between layers; with 8, storing the caches that the
# prefill's sub-batches of one sequence complete is the peak), then generations
# whose last decode pass is the peak (on nvme, the segments of the cache are loaded
# and joined, or read into one buffer where a position's keys and values of a
# sub-batch fill a page: none is kept in memory once stored).
MEMORY_CASES = [
    (2, 2, "device", "device", 32, 2, 64),
    (4, 2, "nvme", "nvme", 32, 2, 64),
    (8, 2, "device", "nvme", 32, 2, 64),
    (1, 4, "device", "device", 4, 40, 64),
    (2, 2, "device", "nvme", 4, 12, 64),
    (1, 1, "device", "nvme", 4, 12, 128),
]


def test_a_generation_policy_of_the_kit_writes_the_passes_and_a_bad_one_is_refused_before_anything_runs(tmp_path):
    """`schedule=` takes a `Policy` of `PassRequest`s: one that issues every layer's
    weights at the start of the pass gives eager's tokens and its schedules; one
    that leaves out the suffix is refused, naming the step; a training policy's name
    is refused."""
    import dataclasses

    from slcompile.schedules import Policy
    from slcompile.schedules.base import Schedule
    from slcompile.schedules.generation import generation_pass

    def all_ahead(request):
        return generation_pass(dataclasses.replace(request, live_blocks=request.layers))

    def no_suffix(request):
        return Schedule(generation_pass(request).steps[:-1])

    model = hf_llama(num_hidden_layers=3, hidden_size=64, vocab_size=VOCAB).eval()
    input_ids = torch.randint(3, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    options = dict(num_subbatches=2, weights="nvme", offload_dir=str(tmp_path))
    expected = eager_generate(model, input_ids, None, 3, eos=[])
    output = run_generate(model, input_ids, None, 3, [], schedule=Policy("all_ahead", all_ahead),
                          return_dict_in_generate=True, **options)
    assert torch.equal(output.sequences, expected)
    wider = explain_generation(model, input_ids.shape, 3, live_blocks=3, **options)
    assert [step.schedule for step in output.steps] == [step.schedule for step in wider.steps]
    with pytest.raises(slcompile.PolicyError, match=r"'no_suffix' at step `prefill suffix`: a step of the pass is"):
        run_generate(model, input_ids, None, 3, [], schedule=Policy("no_suffix", no_suffix), **options)
    with pytest.raises(slcompile.OptionError, match="schedule='grad_accumulation': a generation pass is written"):
        run_generate(model, input_ids, None, 3, [], schedule="grad_accumulation", **options)


def test_a_wider_window_of_live_layers_gives_the_tokens_of_eager_and_holds_one_layer_more(tmp_path):
    """`live_blocks=3` on nvme: each layer's weights load two layers ahead, once per
    pass as with 2; the predicted peak holds one more layer's weights, within 5% of
    the measured one."""
    model = hf_llama(num_hidden_layers=3, hidden_size=64, vocab_size=VOCAB).eval()
    input_ids = torch.randint(3, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    options = dict(num_subbatches=2, weights="nvme", offload_dir=str(tmp_path))
    explained = {live: explain_generation(model, input_ids.shape, 3, machine=_as_measured(), live_blocks=live,
                                          **options) for live in (2, 3)}
    layer = explained[3].prefill_memory.terms["weights"] - explained[2].prefill_memory.terms["weights"]
    assert 0 < layer < explained[2].prefill_memory.terms["weights"]
    assert [step.bytes_moved for step in explained[3].steps] == [step.bytes_moved for step in explained[2].steps]
    expected = eager_generate(model, input_ids, None, 3, eos=[])
    output = run_generate(model, input_ids, None, 3, [], live_blocks=3, return_dict_in_generate=True, **options)
    assert torch.equal(output.sequences, expected)
    assert [step.schedule for step in output.steps] == [step.schedule for step in explained[3].steps]
    measured = measured_generate_peak(model, input_ids, 3, live_blocks=3, **options)
    predicted = explained[3].peak_bytes - explained[3].prefill_memory.resident_bytes
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured, str(explained[3]))


@pytest.mark.parametrize("prefill_k,k,weights,kv_cache,length,new_tokens,hidden", MEMORY_CASES)
def test_explained_device_peak_of_prefill_and_decode_within_five_percent_of_measured(
        tmp_path, prefill_k, k, weights, kv_cache, length, new_tokens, hidden):

    model = hf_llama(num_hidden_layers=2, hidden_size=hidden, vocab_size=VOCAB).eval()
    input_ids = torch.randint(3, VOCAB, (8, length), generator=torch.Generator().manual_seed(0))
    options = dict(num_subbatches=k, prefill_subbatches=prefill_k, weights=weights, kv_cache=kv_cache,
                   offload_dir=str(tmp_path))
    # Inside `buffers_seen_by_profiler` each loaded tensor carries one page of slack.
    explained = explain_generation(model, input_ids.shape, new_tokens, machine=_as_measured(), **options)
    prefill, decode = explained.prefill_memory, explained.decode_memory
    assert (decode.peak_bytes > prefill.peak_bytes) == (new_tokens > 2), (prefill, decode)
    assert prefill.resident_bytes == decode.resident_bytes
    if weights == "nvme":
        assert prefill.terms["weights"] > 0 and prefill.resident_bytes < sum(
            p.numel() * 4 for p in model.parameters())
    expected = eager_generate(model, input_ids, None, new_tokens, eos=[])
    assert torch.equal(run_generate(model, input_ids, None, new_tokens, [], **options), expected)
    measured = measured_generate_peak(model, input_ids, new_tokens, **options)
    predicted = explained.peak_bytes - prefill.resident_bytes
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured, str(explained))


def test_explained_device_peak_of_left_padded_prompts_within_five_percent_of_measured(tmp_path):
    """Padded prompts make the model build a mask per sub-batch, which an offloading
    prefill holds for every sub-batch through the pass: `padded=True` counts them."""

    model = hf_llama(num_hidden_layers=2, hidden_size=64, vocab_size=VOCAB).eval()
    input_ids, mask = left_padded_batch(batch=16, length=60)
    input_ids[:, 0], mask[:, 0] = PAD, 0  # every sequence padded
    options = dict(num_subbatches=2, prefill_subbatches=8, weights="device", kv_cache="nvme",
                   offload_dir=str(tmp_path))
    measured = measured_generate_peak(model, input_ids, 2, mask=mask, **options)
    padded, unpadded = (explain_generation(model, input_ids.shape, 2, machine=_as_measured(), padded=p, **options)
                        for p in (True, False))
    predicted = padded.peak_bytes - padded.prefill_memory.resident_bytes
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured, str(padded))
    assert padded.prefill_memory.terms["hidden"] > unpadded.prefill_memory.terms["hidden"]


@pytest.mark.cuda_check
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt2"])
@pytest.mark.usefixtures("without_collections")
def test_prefill_with_hidden_states_on_the_kv_tier_gives_the_tokens_of_eager(tmp_path, family):
    """Four prefill sub-batches, each captured alone before each layer step and its
    logits computed after the last, its hidden states on nvme in between (moved by
    the spill ops a compiled graph uses, every one freed once taken); left padding,
    early EOS."""
    from slcompile.runtime.storage.engine import get_engine
    from slcompile.runtime.ops import pending_tokens

    model = FAMILIES[family]().eval()
    input_ids, mask = left_padded_batch(batch=8, length=7)
    eos = early_eos(model, input_ids, mask, 5)
    expected = eager_generate(model, input_ids, mask, 5, eos=[eos])
    tokens = pending_tokens()
    out = run_generate(model, input_ids, mask, 5, [eos], num_subbatches=2, prefill_subbatches=4, kv_cache="nvme",
                       offload_dir=str(tmp_path), return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.steps[0].bytes_of(TransferKind.ACTIVATION, Tier.NVME, Tier.DEVICE) == 8 * 7 * 32 * 4
    assert pending_tokens() == tokens
    assert not [key for key in get_engine(str(tmp_path)).keys() if ".spill." in key]


def test_offloading_prefill_device_memory_grows_with_the_batch_by_logits_and_positions_alone(tmp_path):
    """Sub-batches of one sequence: from batch 32 to 96 the prefill's predicted peak
    grows by the last-position logits the pass returns for each sequence added and
    the position ids the model's inputs hold for it, nothing else (no hidden state,
    embedding, mask or cache of the whole batch); measured within 5% at both."""

    model = hf_llama(num_hidden_layers=2, hidden_size=64, vocab_size=VOCAB).eval()
    peaks = {}
    for batch in (32, 96):
        options = dict(num_subbatches=batch // 4, prefill_subbatches=batch, weights="device", kv_cache="nvme",
                       offload_dir=str(tmp_path))
        explained = explain_generation(model, (batch, 32), 2, machine=_as_measured(), **options)
        peaks[batch] = explained.prefill_memory.peak_bytes - explained.prefill_memory.resident_bytes
        input_ids = torch.randint(3, VOCAB, (batch, 32), generator=torch.Generator().manual_seed(batch))
        measured = measured_generate_peak(model, input_ids, 2, **options)
        assert explained.peak_bytes == explained.prefill_memory.peak_bytes
        assert abs(peaks[batch] - measured) <= 0.05 * measured, (peaks[batch], measured, str(explained))
    assert peaks[96] - peaks[32] == (96 - 32) * (VOCAB * 4 + 32 * 8)


def test_prefill_with_hidden_states_on_the_kv_tier_fits_a_budget_a_device_cache_cannot(tmp_path):
    """Held on the device, a prefill keeps every sequence's hidden states between
    layers and its tail sees the whole batch, whatever K: batch 32 needs 2.4 MB.
    With the cache on nvme, and the hidden states with it, more sub-batches fit less."""
    from slcompile.tune import GenerationBudgetError

    model = hf_llama(num_hidden_layers=2, hidden_size=64, vocab_size=VOCAB).eval()
    shape, new_tokens = (32, 32), 2
    resident = explain_generation(model, shape, new_tokens).prefill_memory.resident_bytes
    budget = resident + 800_000
    with pytest.raises(GenerationBudgetError):
        slcompile.tune_generation(model, shape, new_tokens, memory_budget=budget, weights="device",
                                  kv_cache="device", offload_dir=str(tmp_path))
    result = slcompile.tune_generation(model, shape, new_tokens, memory_budget=budget, weights="device",
                                       kv_cache="nvme", offload_dir=str(tmp_path))
    options = result.options
    assert result.memory.peak_bytes <= budget

    def prefill_peak(k, prefill_k):
        return explain_generation(model, shape, new_tokens, num_subbatches=k, prefill_subbatches=prefill_k,
                                  weights="device", kv_cache="nvme").prefill_memory.peak_bytes

    # The fewest that fit: half the prefill's sub-batches would not; with half the
    # decode's, the decode would not, or no prefill would (it fills the rows of each
    # decode sub-batch's cache of a layer before storing them).
    k, prefill_k = options["num_subbatches"], options["prefill_subbatches"]
    assert prefill_k > 1 and prefill_peak(k, prefill_k // 2) > budget
    assert k > 1
    half = explain_generation(model, shape, new_tokens, num_subbatches=k // 2, prefill_subbatches=32, weights="device",
                              kv_cache="nvme")
    assert half.decode_memory.peak_bytes > budget or all(prefill_peak(k // 2, p) > budget for p in (1, 2, 4, 8, 16, 32))
    input_ids = torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(2))
    expected = eager_generate(model, input_ids, None, new_tokens, eos=[])
    options["offload_dir"] = str(tmp_path)
    assert torch.equal(run_generate(model, input_ids, None, new_tokens, [], **options), expected)
    measured = measured_generate_peak(model, input_ids, new_tokens, **options)
    assert measured + resident <= budget
    assert abs(result.memory.peak_bytes - resident - measured) <= 0.05 * measured


def test_tune_generation_picks_the_fewest_subbatches_that_fit_and_refuses_a_budget_nothing_fits(tmp_path):
    from slcompile.tune import GenerationBudgetError

    model = hf_llama(num_hidden_layers=2, hidden_size=64, vocab_size=VOCAB).eval()
    shape, new_tokens = (8, 32), 2
    peaks = {k: explain_generation(model, shape, new_tokens, num_subbatches=k).peak_bytes for k in (1, 2, 4)}
    # Past two sub-batches the tail (the whole batch's last hidden states) is the peak.
    assert peaks[1] > peaks[2] >= peaks[4]
    budget = (peaks[2] + peaks[1]) // 2
    result = slcompile.tune_generation(model, shape, new_tokens, memory_budget=budget, weights="device",
                                       kv_cache="device", offload_dir=str(tmp_path))
    options = result.options
    assert options == {"num_subbatches": options["num_subbatches"], "prefill_subbatches": 2,
                       "weights": "device", "kv_cache": "device", "live_blocks": 2}
    assert result.memory.peak_bytes <= budget
    # A smaller K would not fit, as predicted.
    k = options["num_subbatches"]
    smaller = explain_generation(model, shape, new_tokens, num_subbatches=k, prefill_subbatches=1)
    assert smaller.prefill_memory.peak_bytes > budget
    if k > 1:
        assert explain_generation(model, shape, new_tokens, num_subbatches=k // 2).decode_memory.peak_bytes > budget
    # The chosen options fit as measured.
    input_ids = torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(1))
    measured = measured_generate_peak(model, input_ids, new_tokens, **options)
    assert measured + result.memory.prefill_memory.resident_bytes <= budget
    with pytest.raises(GenerationBudgetError, match=r"^generation needs at least (\d+) bytes") as error:
        slcompile.tune_generation(model, shape, new_tokens, memory_budget=1000, offload_dir=str(tmp_path))
    assert isinstance(error.value, slcompile.BudgetError) and error.value.smallest > 1000
    # The smallest budget named fits.
    assert slcompile.tune_generation(model, shape, new_tokens, memory_budget=error.value.smallest,
                                     offload_dir=str(tmp_path)).memory.peak_bytes <= error.value.smallest


@pytest.mark.oldest
@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_without_a_mask_the_pad_token_masks_as_model_generate_infers_it(pad_is_eos):
    """No `attention_mask`: the mask is `input_ids != pad_token_id` when the pad token
    is in the prompts and is no EOS token, else none, as `model.generate` infers it;
    both read the pad and EOS tokens from the generation config."""
    model = FAMILIES["llama"]().eval()
    input_ids, _ = left_padded_batch()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = [PAD, VOCAB - 1] if pad_is_eos else VOCAB - 1
    expected = model.generate(input_ids, max_new_tokens=6, do_sample=False)
    out = slcompile.generate(copy.deepcopy(model), input_ids, max_new_tokens=6, num_subbatches=2,
                             backend="aot_eager", progress=False)
    assert torch.equal(out, expected), (out, expected)
    masked = model.generate(input_ids, attention_mask=(input_ids != PAD).long(), max_new_tokens=6, do_sample=False)
    assert torch.equal(expected, masked) != pad_is_eos


@pytest.mark.oldest
def test_model_generate_inside_generation_runs_layer_major_with_the_tokens_of_eager(tmp_path):
    model = FAMILIES["llama"]().eval()
    input_ids, mask = left_padded_batch()
    expected = eager_generate(model, input_ids, mask, 6, eos=[])
    slcompile.reset_runtime_stats()
    with slcompile.generation(model, num_subbatches=2, kv_cache="nvme", backend="aot_eager", progress=False,
                              offload_dir=str(tmp_path)):
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=[],
                             pad_token_id=PAD, return_dict_in_generate=True)
        with pytest.raises(slcompile.OptionError, match="num_beams is not supported"):
            model.generate(input_ids, max_new_tokens=2, num_beams=2)
    assert torch.equal(out.sequences, expected)
    assert [step.subbatches for step in out.steps] == [(0, 1)] * 6
    assert slcompile.runtime_stats().cumulative.bytes_moved[KV_STORED] > 0
    # Outside the block, model.generate is the model's own again.
    assert "generate" not in model.__dict__
    assert torch.equal(eager_generate(model, input_ids, mask, 6, eos=[]), expected)
    with pytest.raises(slcompile.OptionError, match="^generation: beams is not an option"):
        with slcompile.generation(model, beams=2):
            pass


def test_explain_without_a_traceable_forward_logs_and_tune_generation_refuses(monkeypatch, caplog):
    from slcompile.inference.memory import _MemoryModel

    model = FAMILIES["llama"]().eval()

    def untraceable(*args, **kwargs):
        raise RuntimeError("data-dependent branch")

    monkeypatch.setattr(_MemoryModel, "_traced", untraceable)
    explained = explain_generation(model, (4, 6), 3, num_subbatches=2)
    assert explained.prefill_memory is None and explained.peak_bytes is None and len(explained.steps) == 3
    assert "not predicted: tracing its forward on fake tensors failed (RuntimeError" in caplog.text
    with pytest.raises(slcompile.RefusedError, match="cannot be predicted"):
        slcompile.tune_generation(model, (4, 6), 3, memory_budget="1GiB")


def test_kv_store_keeps_no_stored_tensor_alive_once_its_store_is_done(tmp_path):
    from torch.multiprocessing.reductions import StorageWeakRef

    from slcompile.runtime.storage.engine import TransferEngine
    from slcompile.runtime.kv import KVStore

    engine = TransferEngine(offload_dir=str(tmp_path))
    store = KVStore(engine, "nvme")
    keys, values = torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4)
    memory = [StorageWeakRef(keys.untyped_storage()), StorageWeakRef(values.untyped_storage())]
    store.store(0, 0, keys, values, new=5)
    store.flush()
    del keys, values
    assert all(ref.expired() for ref in memory)
    loaded_keys, _ = store.take(0, 0)
    assert loaded_keys.shape == (2, 2, 5, 4)
    store.close()
    engine.close()


def test_each_layer_step_and_each_pass_pay_the_profile_s_generation_costs():
    """`MachineProfile.layer_step_seconds` per (layer, sub-batch) step and
    `pass_seconds` per pass, on top of the ops: with everything on the device (no
    transfer to wait for) they add exactly that to each pass."""
    import dataclasses

    from slcompile.analysis.machine import MachineProfile

    model = FAMILIES["llama"]().eval()  # two layers
    bare = MachineProfile(name="synthetic", matmul_flops=1e9, memory_bandwidth=1e10, call_overhead_seconds=1e-5)
    costly = dataclasses.replace(bare, layer_step_seconds=0.5, pass_seconds=2.0)
    options = dict(num_subbatches=2, prefill_subbatches=4)
    without, with_costs = (explain_generation(model, (4, 6), 5, profile=p, **options) for p in (bare, costly))
    assert with_costs.prefill_time.step_seconds - without.prefill_time.step_seconds == pytest.approx(2 * 4 * 0.5 + 2)
    assert with_costs.decode_time.step_seconds - without.decode_time.step_seconds == pytest.approx(2 * 2 * 0.5 + 2)
    assert with_costs.seconds - without.seconds == pytest.approx(6 + 4 * 4)


def test_explain_generation_times_the_bytes_each_pass_moves_and_generate_measures_each_pass(tmp_path):
    from slcompile.analysis.machine import MachineProfile

    model = FAMILIES["llama"]().eval()
    input_ids, mask = left_padded_batch(batch=4, length=6)
    options = dict(num_subbatches=2, prefill_subbatches=4, weights="nvme", kv_cache="nvme", offload_dir=str(tmp_path))
    profile = MachineProfile(name="synthetic", matmul_flops=1e9, memory_bandwidth=1e12, nvme_read=1e6,
                             nvme_write=1e6)
    explained = explain_generation(model, input_ids.shape, 5, profile=profile, **options)
    # The timelines move exactly the bytes the passes move (which generate measures),
    # on the disk lane: weights, hidden states and caches, loads and stores.
    assert explained.prefill_time.lane_bytes() == {"disk": sum(explained.steps[0].bytes_moved.values())}
    assert explained.decode_time.lane_bytes() == {"disk": sum(explained.steps[2].bytes_moved.values())}
    # At 1 MB/s the disk bounds every pass; the generation is the prefill and four decode passes.
    assert explained.prefill_time.bound == explained.decode_time.bound == "disk"
    assert explained.seconds == pytest.approx(explained.prefill_time.step_seconds
                                              + 4 * explained.decode_time.step_seconds)
    assert "predicted generation" in str(explained)
    assert explain_generation(model, input_ids.shape, 5, **options).prefill_time is None
    out = run_generate(model, input_ids, mask, 5, [], return_dict_in_generate=True, **options)
    assert all(step.seconds > 0 for step in out.steps)
    assert all(step.seconds is None for step in explained.steps)
    assert out.steps == explained.steps
