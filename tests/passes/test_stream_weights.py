"""stream_weights, tag_fetch_views and place_prefetches alone on a two-block MLP: the
blocks' weights are fetched once per block (or once per sub-batch, as gradient
accumulation loads them), views of a fetch are recomputed with it, and each fetch's
load is issued a block ahead."""

import torch
from expecttest import assert_expected_inline
from torch.utils.checkpoint import CheckpointPolicy

from slcompile.passes.stream_weights import place_prefetches, stream_weights, tag_fetch_views
from slcompile.vocabulary import FETCH_WEIGHT
from tests.passes.conftest import weight_key


class _Resident(torch.fx.Interpreter):
    """Runs a graph whose fetches return their parameter, as a resident weight."""

    def call_function(self, target, args, kwargs):
        if target is FETCH_WEIGHT:
            return args[0]
        return super().call_function(target, args, kwargs)


def _stream(state, printer, per_subbatch=False):
    before = printer.lines(state.gm)
    k = state.config.num_subbatches
    groups = {(block.index, sb): sb for block in state.blocks.blocks for sb in range(k)} if per_subbatch else None
    gm, weights = stream_weights(
        state.gm, state.blocks, state.inputs, lambda name, value: printer.name(name), weight_key,
        fetch_groups=groups,
    )
    return printer.diff(before, printer.lines(gm)), weights


def test_stream_weights_fetches_each_block_weight_once(pipeline, printer, mlp):
    state = pipeline("interleave")
    diff, weights = _stream(state, printer)
    assert_expected_inline(diff, """\
-linear_1_sb0 = linear(x_sb0, layers.0.linear.weight, layers.0.linear.bias)  # blk0.sb0
+fetch_weight_default = fetch_weight.default(layers.0.linear.weight, 'w0|layers.0.linear.weight@fwd')  # blk0
+fetch_weight_default_1 = fetch_weight.default(layers.0.linear.bias, 'w0|layers.0.linear.bias@fwd')  # blk0
+linear_1_sb0 = linear(x_sb0, fetch_weight_default, fetch_weight_default_1)  # blk0.sb0
-linear_1_sb1 = linear(x_sb1, layers.0.linear.weight, layers.0.linear.bias)  # blk0.sb1
+linear_1_sb1 = linear(x_sb1, fetch_weight_default, fetch_weight_default_1)  # blk0.sb1
-linear_2_sb0 = linear(x_1_sb0, layers.1.linear.weight, layers.1.linear.bias)  # blk1.sb0
+fetch_weight_default_2 = fetch_weight.default(layers.1.linear.weight, 'w0|layers.1.linear.weight@fwd')  # blk1
+fetch_weight_default_3 = fetch_weight.default(layers.1.linear.bias, 'w0|layers.1.linear.bias@fwd')  # blk1
+linear_2_sb0 = linear(x_1_sb0, fetch_weight_default_2, fetch_weight_default_3)  # blk1.sb0
-linear_2_sb1 = linear(x_1_sb1, layers.1.linear.weight, layers.1.linear.bias)  # blk1.sb1
+linear_2_sb1 = linear(x_1_sb1, fetch_weight_default_2, fetch_weight_default_3)  # blk1.sb1""")
    blocks = [[(printer.name(name), key) for name, key in block] for block in weights.blocks]
    assert_expected_inline(
        f"{blocks}\nresident: {[(printer.name(n), why) for n, why in weights.resident]}\n"
        f"{weights.streamed_bytes} B", """\
[[('layers.0.linear.weight', 'layers.0.linear.weight'), ('layers.0.linear.bias', 'layers.0.linear.bias')], [('layers.1.linear.weight', 'layers.1.linear.weight'), ('layers.1.linear.bias', 'layers.1.linear.bias')]]
resident: [('embed.weight', 'read by the prefix or suffix'), ('embed.bias', 'read by the prefix or suffix'), ('head.weight', 'read by the prefix or suffix'), ('head.bias', 'read by the prefix or suffix')]
576 B""")
    model, x = mlp
    torch.testing.assert_close(_Resident(state.gm).run(*state.example_inputs)[0], model(x))


def test_stream_weights_per_subbatch_fetches_for_each_subbatch(pipeline, printer):
    state = pipeline("interleave", schedule="grad_accumulation")
    diff, _ = _stream(state, printer, per_subbatch=True)
    assert_expected_inline(diff, """\
-linear_1_sb0 = linear(x_sb0, layers.0.linear.weight, layers.0.linear.bias)  # blk0.sb0
+fetch_weight_default = fetch_weight.default(layers.0.linear.weight, 'w0|layers.0.linear.weight#sb0@fwd')  # blk0.sb0
+fetch_weight_default_2 = fetch_weight.default(layers.0.linear.bias, 'w0|layers.0.linear.bias#sb0@fwd')  # blk0.sb0
+linear_1_sb0 = linear(x_sb0, fetch_weight_default, fetch_weight_default_2)  # blk0.sb0
-linear_2_sb0 = linear(x_1_sb0, layers.1.linear.weight, layers.1.linear.bias)  # blk1.sb0
+fetch_weight_default_4 = fetch_weight.default(layers.1.linear.weight, 'w0|layers.1.linear.weight#sb0@fwd')  # blk1.sb0
+fetch_weight_default_6 = fetch_weight.default(layers.1.linear.bias, 'w0|layers.1.linear.bias#sb0@fwd')  # blk1.sb0
+linear_2_sb0 = linear(x_1_sb0, fetch_weight_default_4, fetch_weight_default_6)  # blk1.sb0
-linear_1_sb1 = linear(x_sb1, layers.0.linear.weight, layers.0.linear.bias)  # blk0.sb1
+fetch_weight_default_1 = fetch_weight.default(layers.0.linear.weight, 'w0|layers.0.linear.weight#sb1@fwd')  # blk0.sb1
+fetch_weight_default_3 = fetch_weight.default(layers.0.linear.bias, 'w0|layers.0.linear.bias#sb1@fwd')  # blk0.sb1
+linear_1_sb1 = linear(x_sb1, fetch_weight_default_1, fetch_weight_default_3)  # blk0.sb1
-linear_2_sb1 = linear(x_1_sb1, layers.1.linear.weight, layers.1.linear.bias)  # blk1.sb1
+fetch_weight_default_5 = fetch_weight.default(layers.1.linear.weight, 'w0|layers.1.linear.weight#sb1@fwd')  # blk1.sb1
+fetch_weight_default_7 = fetch_weight.default(layers.1.linear.bias, 'w0|layers.1.linear.bias#sb1@fwd')  # blk1.sb1
+linear_2_sb1 = linear(x_1_sb1, fetch_weight_default_5, fetch_weight_default_7)  # blk1.sb1""")


def test_tag_fetch_views_recomputes_the_views_of_a_fetch(streamed, printer):
    joint = streamed().joint.graph
    tagged = tag_fetch_views(joint)
    recomputed = [node.name for node in joint.nodes if node.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE]
    assert_expected_inline(f"{tagged} views tagged; recomputed: {', '.join(recomputed)}", """8 views tagged; recomputed: fetch_weight, fetch_weight_1, t_2, t_3, fetch_weight_2, fetch_weight_3, t_4, t_5, t_16, t_20, t_24, t_28""")
    assert tag_fetch_views(joint) == 0  # tagged once


def test_place_prefetches_issues_each_load_a_block_ahead(streamed, printer):
    graphs = streamed()
    before = printer.lines(graphs.forward), printer.lines(graphs.backward)
    placed = place_prefetches(graphs.forward, graphs.backward, live_blocks=2)
    assert_expected_inline(f"{placed}", """PlacedPrefetches(visits=(('fwd', 0, None), ('fwd', 1, None), ('bwd', 1, None), ('bwd', 0, None)), issues={'fwd': 3, 'bwd': 3}, ahead=1)""")
    assert_expected_inline(printer.diff(before[0], printer.lines(graphs.forward)), """\
+fetch_issue_default = fetch_issue.default('w0|layers.1.linear.weight@fwd')  # blk0
+fetch_issue_default_1 = fetch_issue.default('w0|layers.1.linear.bias@fwd')  # blk0
+fetch_issue_default_2 = fetch_issue.default('w0|layers.1.linear.weight@bwd')  # blk1""")
    assert_expected_inline(printer.diff(before[1], printer.lines(graphs.backward)), """\
-fetch_weight_2 = fetch_weight.default(primals_6, 'w0|layers.1.linear.weight@fwd')  # blk1
+fetch_issue_default = fetch_issue.default('w0|layers.0.linear.weight@bwd')  # blk1
+fetch_weight_2 = fetch_weight.default(primals_6, 'w0|layers.1.linear.weight@bwd')  # blk1
-fetch_weight = fetch_weight.default(primals_4, 'w0|layers.0.linear.weight@fwd')  # blk0
+fetch_issue_default_1 = fetch_issue.default('w0|layers.0.linear.weight@fwd')  # blk0
+fetch_issue_default_2 = fetch_issue.default('w0|layers.0.linear.bias@fwd')  # blk0
+fetch_weight = fetch_weight.default(primals_4, 'w0|layers.0.linear.weight@bwd')  # blk0""")


def test_place_prefetches_with_one_live_block_only_marks_the_phase(streamed, printer):
    graphs = streamed()
    placed = place_prefetches(graphs.forward, graphs.backward, live_blocks=1)
    assert_expected_inline(f"{placed}", """PlacedPrefetches(visits=(('fwd', 0, None), ('fwd', 1, None), ('bwd', 1, None), ('bwd', 0, None)), issues={'fwd': 0, 'bwd': 0}, ahead=0)""")
    keys = [node.args[1] for gm in (graphs.forward, graphs.backward) for node in gm.graph.nodes
            if node.target is FETCH_WEIGHT]
    assert_expected_inline("\n".join(keys), """\
w0|layers.0.linear.weight@fwd
w0|layers.0.linear.bias@fwd
w0|layers.1.linear.weight@fwd
w0|layers.1.linear.bias@fwd
w0|layers.1.linear.weight@bwd
w0|layers.0.linear.weight@bwd""")
