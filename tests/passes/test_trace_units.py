"""trace_units_once (True, or "auto" on a step of 8 blocks or more): AOTAutograd
traces each distinct (block, sub-batch) unit once, as calls of a subgraph, and the
passes read the graphs a flat trace gives."""

import collections
import copy
import logging
import re

import pytest
import torch
from torch import nn

import slcompile
from slcompile.backends import lowering
from slcompile.meta import module_path
from slcompile.passes import trace_units
from slcompile.passes.trace_units import TracedUnits
from slcompile.runtime import reset_runtime_stats, runtime_stats
from models import GPTConfig, TinyGPT, hf_llama, make_gpt_batch

INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


def _compile_step(model, call, options):
    """(outputs, loss, grads, report) of one training step of a copy of `model`."""
    model = copy.deepcopy(model)
    compiled = torch.compile(model, backend="speedloader", options={
        "lowering": "aot_eager", "on_refusal": "raise", "trace_units_once": True, **options})
    outputs, loss = call(compiled)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return outputs, loss, grads, slcompile.compile_reports()[-1]


def _ops(report):
    """The tensor ops of each partitioned graph (size arithmetic aside: a subgraph
    computes the sizes it reads itself)."""
    return {kind: collections.Counter(str(n.target) for n in graph.graph.nodes
                                      if isinstance(n.target, torch._ops.OpOverload))
            for kind, graph in report.partitioned.items()}


def _saved_paths(report):
    """The module path of each tensor the forward saves for the backward."""
    forward = report.partitioned["forward"]
    saved = forward.graph.find_nodes(op="output")[0].args[0]
    return collections.Counter(
        module_path(stack[-1][0]) if (stack := list((n.meta.get("nn_module_stack") or {}).values())) else ""
        for n in saved if isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor))


def _assert_same_step(flat, once, atol=1e-6, peak_rtol=0.0):
    torch.testing.assert_close(once[0], flat[0], atol=atol, rtol=1e-5)
    torch.testing.assert_close(once[1], flat[1], atol=atol, rtol=1e-5)
    for name, grad in flat[2].items():
        torch.testing.assert_close(once[2][name], grad, atol=atol, rtol=1e-5, msg=name)
    flat_report, once_report = flat[3], once[3]
    assert flat_report.traced_units is None
    # The passes read the graphs they read traced flat: the same ops, schedule,
    # saved values (by module) and predicted memory.
    assert _ops(once_report) == _ops(flat_report)
    assert once_report.schedule == flat_report.schedule
    assert _saved_paths(once_report) == _saved_paths(flat_report)
    for tier, peak in flat_report.memory.peak_bytes.items():
        assert abs(once_report.memory.peak_bytes[tier] - peak) <= peak_rtol * peak, tier
    for graph in once_report.partitioned.values():
        assert not graph.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH)


@pytest.mark.parametrize("k", [2, 4])
def test_a_four_block_gpt_traces_one_subgraph_whatever_k(k):
    cfg = GPTConfig(d_model=32, seq_len=16, n_layers=4, vocab_size=64)
    model = TinyGPT(cfg)
    idx, targets = make_gpt_batch(cfg, 8)

    def call(m):
        return m(idx, targets)

    flat = _compile_step(model, call, {"num_subbatches": k, "trace_units_once": False})
    once = _compile_step(model, call, {"num_subbatches": k})
    traced = once[3].traced_units
    assert (traced.calls, traced.subgraphs, traced.kept) == (4 * k, 1, ())
    # AOTAutograd traced the block's forward once; its backward once for the first
    # three blocks and once for each sub-batch of the last, whose output gradients
    # are views into the whole batch's at K offsets.
    assert traced.variants == k + 1
    _assert_same_step(flat, once)
    eager = copy.deepcopy(model)
    torch.testing.assert_close(once[1], eager(idx, targets)[1], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_under_inductor_the_step_holds_the_ops_of_a_flat_trace():
    """Each subgraph is partitioned as traced and the step's own (min-cut)
    partitioner chooses what the backward recomputes, as for a flat trace."""
    cfg = GPTConfig(d_model=32, seq_len=16, n_layers=2, vocab_size=64)
    model = TinyGPT(cfg)
    idx, targets = make_gpt_batch(cfg, 4)

    def call(m):
        return m(idx, targets)

    options = {"num_subbatches": 2, "lowering": "inductor"}
    flat = _compile_step(model, call, {**options, "trace_units_once": False})
    torch._dynamo.reset()
    once = _compile_step(model, call, options)
    assert once[3].traced_units.calls == 4
    _assert_same_step(flat, once, atol=1e-5)
    # The report keeps the backward as planned, with its traced values, although
    # AOTAutograd cleared the meta of the backward it kept for its cache.
    for report in (flat[3], once[3]):
        backward = report.partitioned["backward"].graph
        assert all("val" in node.meta for node in backward.nodes if node.op == "call_function")


def test_with_weights_and_activations_on_nvme_the_fetched_blocks_are_traced_once():
    """A block's weights are fetched where they are first read, inside its first
    sub-batch's run: the call goes after them."""
    cfg = GPTConfig(d_model=32, seq_len=16, n_layers=3, vocab_size=64)
    model = TinyGPT(cfg)
    idx, targets = make_gpt_batch(cfg, 8)
    options = {"num_subbatches": 2, "weights": "nvme", "activations": "nvme", "min_offload_bytes": 0}

    def call(m):
        return m(idx, targets)

    # The next step's first weights, prefetched as the step ends, land while the
    # counts are read: both steps' are waited for and counted.
    from slcompile.runtime.weights import drain_prefetches

    reset_runtime_stats()
    flat = _compile_step(model, call, {**options, "trace_units_once": False})
    drain_prefetches()
    flat_moved = dict(runtime_stats().bytes_moved)
    torch._dynamo.reset()
    reset_runtime_stats()
    once = _compile_step(model, call, options)
    drain_prefetches()
    traced = once[3].traced_units
    assert (traced.calls, traced.subgraphs, traced.kept) == (6, 1, ())
    _assert_same_step(flat, once)
    assert len(once[3].offloaded_activations.names) == len(flat[3].offloaded_activations.names) > 0
    assert dict(runtime_stats().bytes_moved) == flat_moved


@pytest.mark.slow
def test_llama_with_a_padding_mask_and_a_dynamic_batch_traces_its_layers_once():
    model = hf_llama()
    idx = torch.randint(0, model.config.vocab_size, (4, 8))
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[1, :3] = 0
    torch._dynamo.mark_dynamic(idx, 0)
    torch._dynamo.mark_dynamic(mask, 0)

    def call(m):
        out = m(input_ids=idx, attention_mask=mask, labels=idx)
        return out.logits, out.loss

    flat = _compile_step(model, call, {"num_subbatches": 2, "trace_units_once": False})
    torch._dynamo.reset()
    once = _compile_step(model, call, {"num_subbatches": 2})
    layers = model.config.num_hidden_layers
    traced = once[3].traced_units
    assert (traced.calls, traced.subgraphs, traced.kept) == (2 * layers, 1, ())
    _assert_same_step(flat, once, atol=1e-5)
    # Each copy's saved values name their own layer, not the layer traced.
    assert {re.match(r"model\.layers\.\d+", path).group(0) for path in _saved_paths(once[3])
            if path.startswith("model.layers.")} == {f"model.layers.{i}" for i in range(layers)}


class _WritesItsInput(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        x.add_(1)  # the block's input, written in place
        return self.linear(x) + x


class _WritesItsOwn(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return nn.functional.relu(self.linear(x), inplace=True) + x  # a value of its own


class _Embedded(nn.Module):
    """A linear embedding (its output is no input of the model), three blocks, a head."""

    def __init__(self, make_block, width=8):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(make_block(width) for _ in range(3))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        out = self.head(x)
        return out, out.square().mean()


@pytest.mark.parametrize("block, traced", [
    # One subgraph; its backward traced for the first two blocks and per sub-batch
    # of the last.
    (_WritesItsOwn, TracedUnits(calls=6, subgraphs=1, variants=3)),
    (_WritesItsInput, TracedUnits(calls=0, subgraphs=0, kept=tuple(
        (f"blk{b}.sb{s}", "writes to an input") for b in range(3) for s in range(2)))),
])
def test_a_block_that_writes_to_its_input_is_traced_flat(block, traced, caplog):
    model = _Embedded(block)
    x = torch.randn(4, 8)
    with caplog.at_level(logging.DEBUG, logger="slcompile.passes.trace_units"):
        once = _compile_step(model, lambda m: m(x), {"num_subbatches": 2})
    if traced.calls:
        assert once[3].traced_units == traced
    else:  # nothing cut out: traced flat, and the log says why
        assert once[3].traced_units is None
        assert "blk0.sb0: writes to an input" in caplog.text
    eager = copy.deepcopy(model)
    out, loss = eager(x)
    loss.backward()
    torch.testing.assert_close(once[1], loss)
    for name, p in eager.named_parameters():
        torch.testing.assert_close(once[2][name], p.grad, msg=name)


def test_a_step_whose_calls_fail_to_trace_is_traced_flat(monkeypatch, caplog):
    cfg = GPTConfig(d_model=32, seq_len=16, n_layers=2, vocab_size=64)
    model = TinyGPT(cfg)
    idx, targets = make_gpt_batch(cfg, 4)
    outline = lowering.outline_units

    def broken(gm):
        units = outline(gm)
        for node in units.graph.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH):
            node.args = (node.args[0], node.args[1], *node.args[2:-1])  # an operand short
        units.graph.recompile()
        return units

    monkeypatch.setattr(lowering, "outline_units", broken)
    with caplog.at_level(logging.WARNING, logger="slcompile.backends.lowering"):
        once = _compile_step(model, lambda m: m(idx, targets), {"num_subbatches": 2})
    assert "traced it flat" in caplog.text
    assert once[3].traced_units is None and once[3].fallback_reason is None
    eager = copy.deepcopy(model)
    torch.testing.assert_close(once[1], eager(idx, targets)[1], atol=1e-5, rtol=1e-5)


def test_a_step_that_fails_after_its_calls_are_put_back_is_traced_flat_from_a_clean_report(monkeypatch, caplog):
    """A failure past the inlining (the partitioner's, a pass's) that is not the
    plan's own verdict traces the step flat, with the report as it was before: one
    run of each pass in the log, as a flat compile has."""
    cfg = GPTConfig(d_model=32, seq_len=16, n_layers=2, vocab_size=64)
    model = TinyGPT(cfg)
    idx, targets = make_gpt_batch(cfg, 4)
    run_stage, failed = lowering.run_stage, []

    def fail_once_partitioned(stage, step, *args, **kwargs):
        result = run_stage(stage, step, *args, **kwargs)
        if stage is lowering.PARTITIONED_PASSES and not failed:
            failed.append(stage)
            raise AssertionError("a partitioner's complaint")
        return result

    flat = _compile_step(model, lambda m: m(idx, targets), {"num_subbatches": 2, "trace_units_once": False})
    torch._dynamo.reset()
    monkeypatch.setattr(lowering, "run_stage", fail_once_partitioned)
    with caplog.at_level(logging.WARNING, logger="slcompile.backends.lowering"):
        once = _compile_step(model, lambda m: m(idx, targets), {"num_subbatches": 2})
    assert "a partitioner's complaint); traced it flat" in caplog.text
    assert once[3].traced_units is None
    names = [re.sub(r" \(.*", "", entry) for entry in once[3].pass_log.entries]
    assert names == [re.sub(r" \(.*", "", entry) for entry in flat[3].pass_log.entries]
    _assert_same_step(flat, once)


def test_a_joint_graph_whose_calls_are_not_recognised_is_traced_flat(monkeypatch, caplog):
    """Were a release of torch to rename the calls AOTAutograd makes of a subgraph,
    the passes would read a step whose units they cannot see: it is traced flat."""
    cfg = GPTConfig(d_model=32, seq_len=16, n_layers=2, vocab_size=64)
    model = TinyGPT(cfg)
    idx, targets = make_gpt_batch(cfg, 4)
    monkeypatch.setattr(trace_units, "_IDENTIFIER", re.compile("(?!)"))  # matches nothing
    with caplog.at_level(logging.WARNING, logger="slcompile.backends.lowering"):
        once = _compile_step(model, lambda m: m(idx, targets), {"num_subbatches": 2})
    assert "calls none of the units' subgraphs" in caplog.text and "traced it flat" in caplog.text
    assert once[3].traced_units is None
    for graph in once[3].partitioned.values():
        assert not graph.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH)
    eager = copy.deepcopy(model)
    torch.testing.assert_close(once[1], eager(idx, targets)[1], atol=1e-5, rtol=1e-5)


def test_a_subgraph_backward_s_unread_forward_op_stays_out_of_the_step(caplog):
    """`tune`'s plans at K=1: the CPU flash attention's partitioned backward
    subgraph holds a forward call of the attention nobody reads (a multi-output
    op); copied into the step, the step's partitioner took it for a tensor it
    could not save. Only what a subgraph's outputs read is put in place, as a flat
    trace has it, and the plans are those of a flat trace."""
    cfg = GPTConfig()
    idx, targets = make_gpt_batch(cfg, 8)
    options = {"num_subbatches": 1, "activations": "nvme", "min_offload_bytes": 0, "lowering": "aot_eager"}
    flat = slcompile.tune(TinyGPT(cfg), idx, targets, memory_budget="64MB", trace_units_once=False, **options)
    with caplog.at_level(logging.WARNING, logger="slcompile"):
        once = slcompile.tune(TinyGPT(cfg), idx, targets, memory_budget="64MB", trace_units_once=True, **options)
    assert "traced it flat" not in caplog.text
    assert once.options == {**flat.options, "trace_units_once": True}
    assert once.memory.peak_bytes == flat.memory.peak_bytes


def test_auto_traces_each_unit_once_from_eight_blocks_and_says_so():
    """The default, "auto": a step of 7 blocks is traced flat, one of 8 as calls
    (where the calls start to save time); both equal eager."""
    for layers, once in ((7, False), (8, True)):
        cfg = GPTConfig(n_layers=layers, d_model=16, n_heads=2, seq_len=8)
        model = TinyGPT(cfg)
        idx, targets = make_gpt_batch(cfg, 4)
        eager = copy.deepcopy(model)
        compiled = torch.compile(model, backend="speedloader",
                                 options={"lowering": "aot_eager", "on_refusal": "raise", "num_subbatches": 2})
        loss = compiled(idx, targets)[1]
        loss.backward()
        expected = eager(idx, targets)[1]
        expected.backward()
        torch.testing.assert_close(loss, expected)
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
        traced = slcompile.compile_reports()[-1].traced_units
        assert (traced is not None and traced.calls == 2 * layers) is once, (layers, traced)


def test_trace_units_once_takes_true_false_or_auto():
    with pytest.raises(slcompile.OptionError, match="'trace_units_once' must be True, False or 'auto'"):
        slcompile.options(trace_units_once="yes")
