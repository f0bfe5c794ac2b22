"""find_batch_dim alone on the Dynamo graph of a two-block MLP (the user input is
batched along its first dimension, static size 4 over two sub-batches; a batch that
K does not divide is refused), and with a dynamic batch that reaches the graph as two
symbols: a padding mask and the tokens' hidden states, each marked dynamic, that
nothing in the graph relates (a Hugging Face mask gathered by `arange(batch)` of the
tokens' size, as GPT-NeoX's). Both are the batch; the split graph equals eager, and a
call whose two sizes differ runs the plain graph."""

import copy
import logging

import pytest
import torch
from expecttest import assert_expected_inline
from torch import nn

import slcompile
from slcompile.config import SpeedLoaderConfig
from slcompile.errors import RefusedError
from slcompile.facts import process_facts
from slcompile.passes.find_batch_dim import find_batch_dim
from slcompile.pipeline import run_pipeline

OPTIONS = {"num_subbatches": 2, "lowering": "aot_eager", "on_refusal": "raise"}
WIDTH, SEQ = 8, 6


class _MaskedStack(nn.Module):
    """Each layer keeps the positions the padding mask keeps; the mask row of each
    sample is gathered by the samples' index, `arange` of the hidden states' batch."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, mask):
        samples = torch.arange(x.shape[0])
        keep = mask.bool()[samples[:, None], torch.arange(SEQ)[None, :]]
        for layer in self.layers:
            x = torch.relu(layer(x)) * keep[..., None]
        out = self.head(x)
        return out, out.square().mean()


def _batch(batch, mask_rows=None):
    generator = torch.Generator().manual_seed(batch)
    mask = torch.ones(mask_rows or batch, SEQ, dtype=torch.long)
    mask[1::2, SEQ - 2:] = 0
    x, mask = torch.randn(batch, SEQ, WIDTH, generator=generator), mask
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(mask, 0)
    return x, mask


def _dynamo_graph(model, *inputs):
    captured = []

    def capture(gm, example_inputs):
        captured.append((gm, example_inputs))
        return gm.forward

    torch.compile(model, backend=capture, fullgraph=True)(*inputs)
    return captured[0]


def test_inputs_with_a_batch_symbol_each_are_all_batched():
    gm, example_inputs = _dynamo_graph(_MaskedStack(), *_batch(4))
    symbols = {str(n.meta["example_value"].shape[0]) for n in gm.graph.nodes
               if n.op == "placeholder" and n.name in ("l_x_", "l_mask_")}
    assert len(symbols) == 2  # two symbols for one batch
    config = SpeedLoaderConfig.from_options({"num_subbatches": 2, "lowering": "aot_eager"})
    state = run_pipeline(gm, example_inputs, config, facts=process_facts(config, example_inputs), stop_after="find_batch_dim")
    assert state.batch.dynamic and state.batch.batched_inputs == {"l_x_": 0, "l_mask_": 0}
    assert len(state.batch.batch_symbols) == 2


def test_a_mask_gathered_on_another_symbol_splits_like_eager_and_disagreeing_sizes_run_plainly(caplog):
    model = _MaskedStack()
    eager, compiled_model = copy.deepcopy(model), copy.deepcopy(model)
    compiled = torch.compile(compiled_model, backend="speedloader", options=OPTIONS)
    for batch, mask_rows in ((4, None), (6, None), (4, 6)):
        for m in (eager, compiled_model):
            m.zero_grad(set_to_none=True)
        x, mask = _batch(batch, mask_rows)
        out_ref, loss_ref = eager(x, mask)
        loss_ref.backward()
        with caplog.at_level(logging.WARNING, logger="slcompile"):
            out, loss = compiled(x, mask)
        loss.backward()
        torch.testing.assert_close(out, out_ref)
        for (name, p), (_, q) in zip(eager.named_parameters(), compiled_model.named_parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, msg=name)
    reports = slcompile.compile_reports()
    assert [r.fallback_reason for r in reports] == [None]
    assert "the batched inputs disagree on the batch size (4, 6); running this call with plain" in caplog.text


def test_find_batch_dim_finds_the_user_inputs_first_dimension(pipeline, printer):
    batch = pipeline("find_batch_dim").batch
    assert_expected_inline(
        f"B={batch.batch_size} dim={batch.batch_dim} dynamic={batch.dynamic} symbols={batch.batch_symbols}\n"
        f"batched: {batch.batched_inputs}\n"
        f"index: {', '.join(f'{printer.name(n)}={i}' for n, i in batch.input_index.items())}", """\
B=4 dim=0 dynamic=False symbols=()
batched: {'l_x_': 0}
index: embed.weight=0, embed.bias=1, l_x_=2, layers.0.linear.weight=3, layers.0.linear.bias=4, layers.1.linear.weight=5, layers.1.linear.bias=6, head.weight=7, head.bias=8""")


def test_find_batch_dim_refuses_a_batch_k_does_not_divide(pipeline):
    state = pipeline("classify_inputs")
    with pytest.raises(RefusedError) as info:
        find_batch_dim(state.gm, list(state.inputs), 0, 3)
    assert_expected_inline(str(info.value), """batch size 4 (dim 0 of input l_x_) is not divisible by num_subbatches=3 [find_batch_dim]""")
