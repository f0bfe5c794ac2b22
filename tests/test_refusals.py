"""Every refusal names its reason, and the fallback gives eager's results."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slcompile
from slcompile.backends.speedloader import cudagraphs_apply
from conftest import assert_matches_eager
from models import BatchNormBlock, GPTConfig, Stack, TinyGPT, make_gpt_batch

CFG = GPTConfig()
AOT = {"lowering": "aot_eager"}


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


def test_graph_without_blocks_compiles_plainly_and_is_no_refusal(caplog):
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            out = self.lin(x)
            return out, out.sum()

    x = torch.randn(4, 4)
    options = {**AOT, "num_subbatches": 2, "on_refusal": "raise"}
    with caplog.at_level(logging.WARNING, logger="slcompile"):
        assert_matches_eager(Plain(), lambda m: m(x), options)
    # Its parameters (20 floats) stay on the device: a warning says so.
    assert "no blocks: compiled plainly" in caplog.text and "80 B of parameters stay on the device" in caplog.text
    assert slcompile.compile_reports()[-1].fallback_reason.startswith("no blocks: compiled plainly")
    assert "\n  fallback: no blocks: compiled plainly (" in str(slcompile.explain(Plain(), x, **options))

    # A graph without parameters (a loss after a graph break) is compiled plainly in silence.
    caplog.clear()
    loss = torch.compile(lambda logits: logits.logsumexp(-1).mean(), backend="speedloader", options=options)
    with caplog.at_level(logging.WARNING, logger="slcompile"):
        torch.testing.assert_close(loss(x), x.logsumexp(-1).mean())
    assert caplog.text == ""


def test_on_refusal_raise_raises_with_the_reason():
    model = torch.compile(
        Stack(BatchNormBlock), backend="speedloader", options={**AOT, "num_subbatches": 2, "on_refusal": "raise"}
    )
    with pytest.raises(slcompile.CompileError, match="^.*BatchNorm in training mode") as info:
        model(torch.randn(8, 8))
    assert isinstance(info.value.inner_exception, slcompile.RefusedError)


def test_bad_option_is_a_value_error_whose_first_line_is_ours():
    model = torch.compile(TinyGPT(CFG), backend="speedloader", options={"num_subbatch": 2})
    idx, targets = make_gpt_batch(CFG, 4)
    with pytest.raises(ValueError) as info:
        model(idx, targets)
    first_line = str(info.value).splitlines()[0]
    assert first_line.startswith("unknown speedloader option 'num_subbatch'; did you mean 'num_subbatches'?")
    # Dynamo's bug-report hint is not for a user's typo.
    assert "PyTorch" not in str(info.value)
    assert isinstance(info.value, torch._dynamo.exc.BackendCompilerFailed)


def test_mode_gets_a_message_that_says_what_to_write():
    model = torch.compile(TinyGPT(CFG), backend="speedloader", mode="max-autotune")
    idx, targets = make_gpt_batch(CFG, 4)
    with pytest.raises(slcompile.CompileError) as info:
        model(idx, targets)
    assert str(info.value).splitlines()[0].startswith(
        "the speedloader backend takes mode='default' or mode='reduce-overhead' (its cudagraphs option), not "
        "mode='max-autotune': torch.compile passes either mode or options"
    )


def test_reduce_overhead_asks_for_cuda_graphs_and_says_why_there_are_none():
    # mode= comes without options, so the lowering is the defaults'.
    idx, targets = make_gpt_batch(CFG, 4)
    with slcompile.defaults.patch(lowering="aot_eager", num_subbatches=2):
        assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), mode="reduce-overhead")
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None and report.config.cudagraphs
    assert report.cudagraphs_skipped.startswith("lowering='aot_eager' compiles no kernels to capture")
    # With Inductor on a CPU, nothing reaches Inductor's CUDA graphs.
    config = slcompile.SpeedLoaderConfig(cudagraphs=True)
    fresh = slcompile.CompileReport(config=config)
    assert not cudagraphs_apply(config, [idx, targets], fresh)
    assert fresh.cudagraphs_skipped == "the step's tensors are on cpu, and CUDA graphs need CUDA"
    assert not cudagraphs_apply(slcompile.SpeedLoaderConfig(), [idx], fresh)


def test_offload_dir_is_created_private_when_its_parent_exists(tmp_path):
    offload_dir = tmp_path / "offload"
    model = torch.compile(TinyGPT(CFG), backend="speedloader",
                          options={**AOT, "weights": "nvme", "offload_dir": str(offload_dir)})
    idx, targets = make_gpt_batch(CFG, 4)
    model(idx, targets)[1].backward()
    assert offload_dir.is_dir()
    assert offload_dir.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("where, cause", [
    ("missing/offload", "does not exist, nor does its parent"),
    ("a_file", "is not a directory"),
])
def test_unusable_offload_dir_names_the_cause_when_options_are_set(tmp_path, where, cause):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=f"^speedloader option 'offload_dir': .*{cause}"):
        slcompile.options(weights="nvme", offload_dir=str(tmp_path / where))


def test_empty_offload_dir_is_refused_not_taken_for_the_temp_dir():
    with pytest.raises(ValueError, match="^speedloader option 'offload_dir': the empty path names no directory"):
        slcompile.options(weights="nvme", offload_dir="")


def test_offload_dir_on_a_filesystem_without_new_files_names_the_cause():
    model = torch.compile(TinyGPT(CFG), backend="speedloader",
                          options={**AOT, "weights": "nvme", "offload_dir": "/proc"})
    idx, targets = make_gpt_batch(CFG, 4)
    with pytest.raises(slcompile.CompileError) as info:
        model(idx, targets)
    message = str(info.value)
    assert message.splitlines()[0].startswith("cannot create a private directory in the offload directory: "
                                              "the filesystem takes no new files or folders")
    assert "tensor key" not in message and "PyTorch" not in message


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
