"""mark_regions alone on the partitioned graphs of a two-block MLP: each run of one
(block, sub-batch) tag is bracketed by a pair of markers labelled `"blk0.sb1 fwd"`;
bookkeeping and untagged nodes join the open run."""

import torch
from expecttest import assert_expected_inline

from slcompile.passes.mark_regions import mark_regions


def test_mark_regions_brackets_each_tag_run(partitioned, printer, mlp):
    forward, backward, state = partitioned()
    before = printer.lines(forward)
    _, marks = mark_regions(forward, "forward")
    assert_expected_inline(printer.diff(before, printer.lines(forward)), """\
+mark_default = mark.default('prefix.sb0 fwd', True)
+mark_default_1 = mark.default('prefix.sb0 fwd', False)
+mark_default_2 = mark.default('prefix.sb1 fwd', True)
+mark_default_3 = mark.default('prefix.sb1 fwd', False)
+mark_default_4 = mark.default('blk0.sb0 fwd', True)
+mark_default_5 = mark.default('blk0.sb0 fwd', False)
+mark_default_6 = mark.default('blk0.sb1 fwd', True)
+mark_default_7 = mark.default('blk0.sb1 fwd', False)
+mark_default_8 = mark.default('blk1.sb0 fwd', True)
+mark_default_9 = mark.default('blk1.sb0 fwd', False)
+mark_default_10 = mark.default('blk1.sb1 fwd', True)
+mark_default_11 = mark.default('blk1.sb1 fwd', False)
+mark_default_12 = mark.default('suffix.sb0 fwd', True)
+mark_default_13 = mark.default('suffix.sb0 fwd', False)
+mark_default_14 = mark.default('suffix.sb1 fwd', True)
+mark_default_15 = mark.default('suffix.sb1 fwd', False)
+mark_default_16 = mark.default('suffix fwd', True)
+mark_default_17 = mark.default('suffix fwd', False)""")
    assert_expected_inline("\n".join(f"{r.label}: {', '.join(r.nodes)}" for r in marks.regions), """\
prefix.sb0 fwd: addmm, slice_2, t_1
prefix.sb1 fwd: addmm_1, t_2
blk0.sb0 fwd: addmm_2, relu, detach, t_3
blk0.sb1 fwd: addmm_3, relu_1, detach_1, t_4
blk1.sb0 fwd: addmm_4, relu_2, detach_2, t_5
blk1.sb1 fwd: addmm_5, relu_3, detach_3, t_6
suffix.sb0 fwd: addmm_6, sum_1, t_7
suffix.sb1 fwd: addmm_7, sum_2
suffix fwd: add""")
    _, marks = mark_regions(backward, "backward")
    assert_expected_inline(" | ".join(r.label for r in marks.regions), """suffix.sb1 bwd | suffix.sb0 bwd | blk1.sb1 bwd | blk1.sb0 bwd | blk0.sb1 bwd | blk0.sb0 bwd | prefix.sb1 bwd | prefix.sb0 bwd""")
    # Markers change no value.
    model, x = mlp
    torch.testing.assert_close(torch.fx.Interpreter(forward).run(*state.example_inputs)[0], model(x))
