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
from slcompile.runtime.tiers import Tier, TransferKind

VOCAB = 96
PAD = 0


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


@pytest.mark.parametrize("k", [1, 4])
def test_weight_and_kv_bytes_per_step_are_exact_and_weights_load_once_per_step(tmp_path, k):
    model = FAMILIES["llama"]().eval()
    input_ids, mask = left_padded_batch(batch=4, length=6)
    new_tokens = 8
    expected = eager_generate(model, input_ids, mask, new_tokens, eos=[])
    block_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    slcompile.reset_runtime_stats()
    out = run_generate(model, input_ids, mask, new_tokens, [], num_subbatches=k, weights="nvme", kv_cache="nvme",
                       offload_dir=str(tmp_path))
    assert torch.equal(out, expected)
    moved = slcompile.runtime_stats().cumulative.bytes_moved
    passes = new_tokens  # the prefill and one decode step per token but the last
    # Each layer's weights are loaded once per pass, for all K sub-batches.
    assert moved[(TransferKind.WEIGHT, Tier.NVME, Tier.DEVICE)] == passes * block_bytes
    # The cache after pass t holds 6 + t positions per sequence; pass t stores it and
    # pass t + 1 loads it back, whatever K is.
    stored = sum(kv_bytes(model, 4, 6 + t) for t in range(passes))
    loaded = sum(kv_bytes(model, 4, 6 + t) for t in range(passes - 1))
    assert moved[(TransferKind.KV, Tier.DEVICE, Tier.NVME)] == stored
    assert moved[(TransferKind.KV, Tier.NVME, Tier.DEVICE)] == loaded
    # The weights stay on the tier; a later call on device weights fetches them.
    assert len(slcompile.offloaded_parameters(model)) == len(list(model.model.layers.parameters()))
    assert torch.equal(run_generate(model, input_ids, mask, new_tokens, [], num_subbatches=k), expected)


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
    with pytest.raises(slcompile.OptionError, match=r"max_new_tokens=60 .* over the model's 64 .* max_new_tokens <= 57"):
        run_generate(model, input_ids, mask, 60, [])
    with pytest.raises(slcompile.OptionError, match="kv_cache='disk' is not a tier"):
        run_generate(model, input_ids, mask, 4, [], kv_cache="disk")
    with pytest.raises(slcompile.RefusedError, match="^Stack has no KV cache"):
        run_generate(Stack(lambda width: torch.nn.Linear(width, width)), torch.zeros(2, 3, dtype=torch.long), None, 4, [])
