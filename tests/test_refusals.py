"""Every refusal names its reason, and the fallback gives eager's results."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slcompile
from conftest import assert_matches_eager
from models import GPTConfig, TinyGPT, make_gpt_batch

CFG = GPTConfig()
AOT = {"lowering": "aot_eager"}


class Stack(nn.Module):
    """Blocks of any kind around a linear head; forward(x) -> (out, loss)."""

    def __init__(self, make_block, width=8, n=3):
        super().__init__()
        self.layers = nn.ModuleList(make_block(width) for _ in range(n))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        out = self.head(x)
        return out, out.square().mean()


class BatchNormBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x):
        return self.norm(self.lin(x))


class CenteringBlock(nn.Module):
    """Subtracts the batch mean: a reduction over the batch inside a block."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        h = self.lin(x)
        return h - h.mean(dim=0, keepdim=True)


class ScaleByTotalBlock(nn.Module):
    """Scales by a sum over everything, batch included."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        h = self.lin(x)
        return h / h.abs().sum()


class SoftmaxOverBatchBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return F.softmax(self.lin(x), dim=0)


class CountingBlock(nn.Module):
    """Writes to a buffer in place on every call."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.lin(x)


def _fallback(model, inputs, options, caplog):
    with caplog.at_level(logging.WARNING, logger="slcompile"):
        assert_matches_eager(model, lambda m: m(*inputs), {**AOT, **options})
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is not None
    assert "speedloader: compiling this graph with plain aot_eager instead" in caplog.text
    return report.fallback_reason


@pytest.mark.parametrize(
    "block, words",
    [
        (BatchNormBlock, "BatchNorm in training mode"),
        (CenteringBlock, "mean) in model.layers.0 works along the batch dimension (dim=0)"),
        (ScaleByTotalBlock, "reduces over the batch dimension"),
        (SoftmaxOverBatchBlock, "works along the batch dimension"),
    ],
)
def test_cross_sample_ops_in_blocks_are_refused(block, words, caplog):
    reason = _fallback(Stack(block), (torch.randn(8, 8),), {"num_subbatches": 2}, caplog)
    assert words in reason


def test_batchnorm_in_eval_mode_is_per_sample_and_runs():
    model = Stack(BatchNormBlock).eval()
    x = torch.randn(8, 8)
    assert_matches_eager(model, lambda m: m(x), {**AOT, "num_subbatches": 4})
    assert slcompile.compile_reports()[-1].fallback_reason is None


def test_in_place_write_to_buffer_is_refused(caplog):
    reason = _fallback(Stack(CountingBlock), (torch.randn(8, 8),), {"num_subbatches": 2}, caplog)
    assert "writes in place to buffer" in reason


def test_batch_not_divisible_is_refused(caplog):
    idx, targets = make_gpt_batch(CFG, 6)
    reason = _fallback(TinyGPT(CFG), (idx, targets), {"num_subbatches": 4}, caplog)
    assert "batch size 6" in reason and "not divisible by num_subbatches=4" in reason


def test_no_batch_dimension_is_refused(caplog):
    class Scalars(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, x):
            h = self.layers[1](self.layers[0](self.layers[0].weight * x))
            return h, h.sum()

    reason = _fallback(Scalars(), (torch.tensor(2.0),), {"num_subbatches": 2}, caplog)
    assert "no batch dimension" in reason


def test_model_without_blocks_is_refused(caplog):
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            out = self.lin(x)
            return out, out.sum()

    reason = _fallback(Plain(), (torch.randn(4, 4),), {"num_subbatches": 2}, caplog)
    assert "no repeated blocks" in reason


def test_on_refusal_raise_raises_with_the_reason():
    model = torch.compile(
        Stack(BatchNormBlock), backend="speedloader", options={**AOT, "num_subbatches": 2, "on_refusal": "raise"}
    )
    with pytest.raises(Exception, match="BatchNorm in training mode") as info:
        model(torch.randn(8, 8))
    assert isinstance(info.value.__cause__ or info.value, (slcompile.RefusedError, Exception))


def test_bad_option_is_a_clear_error():
    model = torch.compile(TinyGPT(CFG), backend="speedloader", options={"num_subbatch": 2})
    idx, targets = make_gpt_batch(CFG, 4)
    with pytest.raises(Exception, match="unknown speedloader option 'num_subbatch'"):
        model(idx, targets)


def test_graph_break_each_graph_handled_on_its_own():
    class Broken(TinyGPT):
        def forward(self, idx, targets=None):
            seq = idx.shape[1]
            x = self.tok(idx) + self.pos(torch.arange(seq, device=idx.device))
            # Unrolled: Dynamo resumes after a break outside a loop.
            x = self.layers[1](self.layers[0](x))
            torch._dynamo.graph_break()
            x = self.layers[3](self.layers[2](x))
            logits = self.head(self.ln_f(x))
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
            return logits, loss

    idx, targets = make_gpt_batch(CFG, 8)
    assert_matches_eager(Broken(CFG), lambda m: m(idx, targets), {**AOT, "num_subbatches": 2})
    reports = slcompile.compile_reports()
    assert len(reports) == 2
    assert [r.fallback_reason for r in reports] == [None, None]
    assert reports[0].blocks == ("layers.0", "layers.1")
    assert reports[1].blocks == ("layers.2", "layers.3")
