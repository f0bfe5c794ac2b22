"""outline_regions alone on the partitioned graphs of a two-block MLP: each (block,
sub-batch) run becomes a call of a subgraph, the copies of one block call the same
subgraph, and the graph computes what it did; then the compiled stage's pass table
around it."""

import torch
from expecttest import assert_expected_inline

from slcompile.meta import get_slc_meta
from slcompile.passes.outline_regions import outline_regions


def test_outline_regions_calls_one_subgraph_per_distinct_region(partitioned, printer, mlp):
    forward, backward, state = partitioned()
    before = printer.lines(forward)
    step, done = outline_regions(forward)
    assert printer.lines(forward) == before  # the graph is read, not changed
    assert_expected_inline(str(done), """RegionOutline(regions=4, subgraphs=1, outside_nodes=7)""")
    assert_expected_inline("\n".join(printer.lines(step)), """\
slice_1 = slice.Tensor(primals_3, 0, 0, 2)  # prefix.sb0
t = t.default(primals_1)  # prefix.sb0
addmm = addmm.default(primals_2, slice_1, t)  # prefix.sb0
slice_2 = slice.Tensor(primals_3, 0, 2, 4)  # prefix.sb1
t_1 = t.default(primals_1)  # prefix.sb1
addmm_1 = addmm.default(primals_2, slice_2, t_1)  # prefix.sb1
t_2 = t.default(primals_4)  # blk0.sb0
invoke_subgraph = invoke_subgraph(slc_region_0, 'slc_region_0', primals_5, addmm, t_2)
getitem = getitem(invoke_subgraph, 0)  # blk0.sb0
getitem_1 = getitem(invoke_subgraph, 1)  # blk0.sb0
t_3 = t.default(primals_4)  # blk0.sb1
invoke_subgraph_1 = invoke_subgraph(slc_region_0, 'slc_region_0', primals_5, addmm_1, t_3)
getitem_2 = getitem(invoke_subgraph_1, 0)  # blk0.sb1
getitem_3 = getitem(invoke_subgraph_1, 1)  # blk0.sb1
t_4 = t.default(primals_6)  # blk1.sb0
invoke_subgraph_2 = invoke_subgraph(slc_region_0, 'slc_region_0', primals_7, getitem, t_4)
getitem_4 = getitem(invoke_subgraph_2, 0)  # blk1.sb0
getitem_5 = getitem(invoke_subgraph_2, 1)  # blk1.sb0
t_5 = t.default(primals_6)  # blk1.sb1
invoke_subgraph_3 = invoke_subgraph(slc_region_0, 'slc_region_0', primals_7, getitem_2, t_5)
getitem_6 = getitem(invoke_subgraph_3, 0)  # blk1.sb1
getitem_7 = getitem(invoke_subgraph_3, 1)  # blk1.sb1
t_6 = t.default(primals_8)  # suffix.sb0
addmm_6 = addmm.default(primals_9, getitem_4, t_6)  # suffix.sb0
sum_1 = sum.default(addmm_6)  # suffix.sb0
t_7 = t.default(primals_8)  # suffix.sb1
addmm_7 = addmm.default(primals_9, getitem_6, t_7)  # suffix.sb1
sum_2 = sum.default(addmm_7)  # suffix.sb1
add = add.Tensor(sum_1, sum_2)  # suffix
return [add, slice_1, addmm, slice_2, addmm_1, t_2, getitem, getitem_1, t_3, getitem_2, getitem_3, t_4, getitem_4, getitem_5, t_5, getitem_6, getitem_7, t_6, t_7]""")
    assert_expected_inline(step.slc_region_0.code.strip(), """\
def forward(self, arg0, arg1, arg2):
    addmm_default = torch.ops.aten.addmm.default(arg0, arg1, arg2);  arg0 = arg1 = arg2 = None
    relu_default = torch.ops.aten.relu.default(addmm_default);  addmm_default = None
    detach_default = torch.ops.aten.detach.default(relu_default)
    return (relu_default, detach_default)""")

    # The backward's regions differ from the forward's (two subgraphs: the first
    # block's backward computes no input gradient); the step computes what the
    # graphs did.
    backward_step, backward_done = outline_regions(backward)
    assert_expected_inline(str(backward_done), """RegionOutline(regions=4, subgraphs=2, outside_nodes=14)""")
    outputs = step(*state.example_inputs)
    loss, saved = outputs[0], outputs[1:]
    grads = backward_step(*saved, torch.ones_like(loss))
    model, x = mlp
    torch.testing.assert_close(loss, model(x))
    eager = torch.autograd.grad(model(x), [p for p in state.example_inputs if p.requires_grad])
    torch.testing.assert_close([g for g in grads if g is not None], list(eager))


def test_outline_regions_leaves_a_graph_without_block_regions():
    assert outline_regions(torch.fx.symbolic_trace(torch.nn.Linear(2, 2))) is None


def _compiled_stage(forward, monkeypatch, disable="", device="cpu"):
    """The compiled stage of the pass table on `forward`, as Inductor's lowering runs
    it on a `device` machine: (the step state, the passes run)."""
    from slcompile.analysis.machine import MachineFacts
    from slcompile.backends.lowering import StepPlan
    from slcompile.config import SpeedLoaderConfig
    from slcompile.passes.manager import PassLog
    from slcompile.pipeline import COMPILED_PASSES, StepState, run_stage
    from slcompile.report import CompileReport

    monkeypatch.setenv("SLC_DISABLE", disable)
    config = SpeedLoaderConfig.from_options({"num_subbatches": 2, "lowering": "inductor", "compile_regions": True})
    plan = StepPlan(block_positions={0: 0, 1: 1}, config=config, machine=MachineFacts(device=device))
    report = CompileReport(config)
    step = StepState(plan, report, {"forward": forward}, kind="forward", lowering="inductor")
    log = PassLog()
    run_stage(COMPILED_PASSES, step, log, label="forward")
    return step, " ".join(entry.split(" (")[0] for entry in log.entries)


def test_the_pass_table_outlines_marked_graphs(partitioned, monkeypatch):
    forward, _, _ = partitioned()
    step, ran = _compiled_stage(forward, monkeypatch)
    assert_expected_inline(ran, """compiled[forward]/annotate_streams compiled[forward]/coalesce_transfers compiled[forward]/mark_regions compiled[forward]/compile_regions compiled[forward]/drop_marks""")
    # The outlined graph replaces the graph; its markers stay around the calls.
    assert step.graphs["forward"] is not forward
    assert step.report.regions["forward"] == step.results.compile_regions
    assert (step.results.drop_marks, _marks(step.graphs["forward"])) == (0, 18)


def test_a_cuda_machine_under_inductor_gets_no_markers(partitioned, monkeypatch):
    # Two host calls a (block, sub-batch) unit, timing when the host issued a region.
    forward, _, _ = partitioned()
    step, _ = _compiled_stage(forward, monkeypatch, device="cuda")
    assert step.results.mark_regions is None and _marks(step.graphs["forward"]) == 0
    assert step.report.regions["forward"] == step.results.compile_regions


def test_a_graph_lowered_flat_loses_its_markers(partitioned, monkeypatch, caplog):
    forward, _, _ = partitioned()
    with caplog.at_level("WARNING"):
        step, ran = _compiled_stage(forward, monkeypatch, disable="compile_regions")
    assert "pass compile_regions skipped (SLC_DISABLE)" in caplog.text
    assert_expected_inline(ran, """compiled[forward]/annotate_streams compiled[forward]/coalesce_transfers compiled[forward]/mark_regions compiled[forward]/drop_marks""")
    assert step.graphs["forward"] is forward and step.report.regions == {}
    assert (step.results.drop_marks, _marks(forward)) == (18, 0)


def _marks(gm) -> int:
    from slcompile.vocabulary import is_mark

    return sum(1 for node in gm.graph.nodes if is_mark(node))


def test_a_size_of_a_regions_own_value_is_computed_in_it_and_again_after_it(monkeypatch):
    # A batch of 2 at K=2 with a batch that changes size: HF Llama's attention views
    # its output as (sub-batch, tokens, -1), and, where the trace guards what the size
    # ranges leave open (the lowering's size-oblivious setting off, as a graph from
    # elsewhere may come), that `-1` is a size the forward graph computes from the
    # view (the sub-batch size might be 0) and also returns for the backward. The
    # region computes it for the next view, the step graph again from what the
    # region returns.
    import contextlib

    import slcompile
    from models import hf_llama
    from slcompile.backends import lowering

    monkeypatch.setattr(lowering, "_sizes_of_any_batch", lambda plan: contextlib.nullcontext())

    model, ids = hf_llama(num_hidden_layers=2), torch.randint(0, 96, (2, 8))
    torch._dynamo.mark_dynamic(ids, 0)
    compiled = torch.compile(model, backend="speedloader",
                             options=slcompile.options(num_subbatches=2, lowering="aot_eager"))
    compiled(ids, labels=ids).loss.backward()
    forward = slcompile.compile_reports()[-1].partitioned["forward"]
    sizes = [node for node in forward.graph.nodes
             if node.op == "call_function" and isinstance(node.meta.get("val"), torch.SymInt)
             and any(getattr(get_slc_meta(source), "block", None) is not None for source in node.all_input_nodes)]
    assert sizes, "no size of a block's value in the graph: the case is not exercised"

    step, done = outline_regions(forward)
    assert (done.regions, done.subgraphs) == (4, 3)
    inputs = [_example(node.meta["val"]) for node in forward.graph.find_nodes(op="placeholder")]
    torch.testing.assert_close(step(*inputs), forward(*inputs))


def _example(value):
    """A value of a placeholder's meta at its traced sizes: ints for token ids."""
    from torch.fx.experimental.symbolic_shapes import guard_int

    if isinstance(value, torch.SymInt):
        return guard_int(value)
    shape = [guard_int(size) for size in value.shape]
    if value.dtype == torch.int64:
        return torch.randint(0, 96, shape)
    return torch.randn(shape, dtype=value.dtype)
