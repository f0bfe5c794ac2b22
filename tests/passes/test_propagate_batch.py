"""propagate_batch alone on the Dynamo graph of a two-block MLP: every node before
the loss runs per sub-batch along dimension 0, the parameters are shared, and the
loss's sum is computed from all sub-batches."""

from expecttest import assert_expected_inline


def test_propagate_batch_splits_every_node_before_the_loss(pipeline, printer):
    plan = pipeline("propagate_batch").plan
    lines = [f"K={plan.num_subbatches} B={plan.batch_size} outputs {plan.output_bdims} problems {plan.problems}"]
    for name, split in plan.nodes.items():
        extra = "".join(
            f", {field} {value}" for field, value in (
                ("narrow", split.narrow), ("combine", split.combine), ("rebase", split.rebase),
                ("from sub-batch 0", split.from_subbatch or None),
            ) if value)
        lines.append(f"{printer.name(name)}: {split.kind} bdims {split.out_bdims}{extra}")
    assert_expected_inline("\n".join(lines), """\
K=2 B=4 outputs (None,) problems ()
embed.weight: shared bdims None
embed.bias: shared bdims None
l_x_: batched bdims 0
layers.0.linear.weight: shared bdims None
layers.0.linear.bias: shared bdims None
layers.1.linear.weight: shared bdims None
layers.1.linear.bias: shared bdims None
head.weight: shared bdims None
head.bias: shared bdims None
x: batched bdims 0
linear_1: batched bdims 0
x_1: batched bdims 0
linear_2: batched bdims 0
x_2: batched bdims 0
linear_3: batched bdims 0
sum_1: combine bdims None, combine sum""")
