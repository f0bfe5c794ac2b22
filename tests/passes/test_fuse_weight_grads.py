"""fuse_weight_grads alone on the backward of a two-block MLP over two sub-batches."""

import copy

import torch
from expecttest import assert_expected_inline

from slcompile.passes.fuse_weight_grads import fuse_weight_grads


def test_fuse_weight_grads_sums_subbatches_in_one_matmul(partitioned, printer, mlp):
    forward, backward, state = partitioned()
    reference = copy.deepcopy(backward)
    before = printer.lines(backward)
    _, fused = fuse_weight_grads(backward)
    assert_expected_inline(f"fused {fused}\n" + printer.diff(before, printer.lines(backward)), """\
fused 3
-mm_5 = mm.default(t_17, relu_1)  # blk1.sb1
-t_18 = t.default(mm_5)  # blk1.sb1
-t_19 = t.default(t_18)  # blk1.sb1
-mm_7 = mm.default(t_21, relu)  # blk1.sb0
-t_22 = t.default(mm_7)  # blk1.sb0
-t_23 = t.default(t_22)  # blk1.sb0
-add_4 = add.Tensor(t_19, t_23)
+cat_default = cat.default([t_17, t_21], 1)  # blk1
+cat_default_1 = cat.default([relu_1, relu], 0)  # blk1
+mm_default = mm.default(cat_default, cat_default_1)
+t_default = t.default(mm_default)
+t_default_1 = t.default(t_default)  # blk1
-mm_9 = mm.default(t_25, addmm_1)  # blk0.sb1
-t_26 = t.default(mm_9)  # blk0.sb1
-t_27 = t.default(t_26)  # blk0.sb1
-mm_11 = mm.default(t_29, addmm)  # blk0.sb0
-t_30 = t.default(mm_11)  # blk0.sb0
-t_31 = t.default(t_30)  # blk0.sb0
-add_6 = add.Tensor(t_27, t_31)
+cat_default_2 = cat.default([t_25, t_29], 1)  # blk0
+cat_default_3 = cat.default([addmm_1, addmm], 0)  # blk0
+mm_default_1 = mm.default(cat_default_2, cat_default_3)
+t_default_2 = t.default(mm_default_1)
+t_default_3 = t.default(t_default_2)  # blk0
-mm_12 = mm.default(t_32, slice_2)  # prefix.sb1
-t_33 = t.default(mm_12)  # prefix.sb1
-t_34 = t.default(t_33)  # prefix.sb1
-mm_13 = mm.default(t_35, slice_1)  # prefix.sb0
-t_36 = t.default(mm_13)  # prefix.sb0
-t_37 = t.default(t_36)  # prefix.sb0
-add_8 = add.Tensor(t_34, t_37)
-return [add_8, add_7, None, add_6, add_5, add_4, add_3, add_2, add_1]
+cat_default_4 = cat.default([t_32, t_35], 1)  # prefix
+cat_default_5 = cat.default([slice_2, slice_1], 0)  # prefix
+mm_default_2 = mm.default(cat_default_4, cat_default_5)
+t_default_4 = t.default(mm_default_2)
+t_default_5 = t.default(t_default_4)  # prefix
+return [t_default_5, add_7, None, t_default_3, add_5, t_default_1, add_3, add_2, add_1]""")

    outputs = torch.fx.Interpreter(forward).run(*state.example_inputs)
    loss, saved = outputs[0], outputs[1:]
    tangent = torch.ones_like(loss)
    got = [g for g in torch.fx.Interpreter(backward).run(*saved, tangent) if g is not None]
    want = [g for g in torch.fx.Interpreter(reference).run(*saved, tangent) if g is not None]
    torch.testing.assert_close(got, want)
    model, x = mlp
    eager = torch.autograd.grad(model(x), [p for p in state.example_inputs if p.requires_grad])
    torch.testing.assert_close(got, list(eager))
