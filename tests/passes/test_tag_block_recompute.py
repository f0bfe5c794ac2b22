"""tag_block_recompute alone on the joint graph of a two-block MLP: the nodes inside a
block are recomputed in the backward, the values that leave a block are saved, the
prefix is left alone; given the units a schedule recomputes, those alone."""

from expecttest import assert_expected_inline

from slcompile.meta import get_slc_meta
from slcompile.passes.offload_activations import tag_block_recompute


def _tagged(joint, units=None) -> str:
    """tag_block_recompute's count, then each tagged node's tag and unit."""
    lines = [f"{tag_block_recompute(joint, units)} tagged"]
    lines += [f"{node.name}: {node.meta['recompute'].name}  # {get_slc_meta(node).tag}"
              for node in joint.nodes if "recompute" in node.meta]
    return "\n".join(lines)


def test_tag_block_recompute_saves_block_outputs_and_recomputes_the_rest(streamed):
    joint = streamed().joint.graph
    assert_expected_inline(_tagged(joint), """\
20 tagged
fetch_weight: MUST_RECOMPUTE  # blk0
fetch_weight_1: MUST_RECOMPUTE  # blk0
t_2: MUST_RECOMPUTE  # blk0.sb0
addmm_2: MUST_RECOMPUTE  # blk0.sb0
relu: MUST_SAVE  # blk0.sb0
detach: MUST_RECOMPUTE  # blk0.sb0
t_3: MUST_RECOMPUTE  # blk0.sb1
addmm_3: MUST_RECOMPUTE  # blk0.sb1
relu_1: MUST_SAVE  # blk0.sb1
detach_1: MUST_RECOMPUTE  # blk0.sb1
fetch_weight_2: MUST_RECOMPUTE  # blk1
fetch_weight_3: MUST_RECOMPUTE  # blk1
t_4: MUST_RECOMPUTE  # blk1.sb0
addmm_4: MUST_RECOMPUTE  # blk1.sb0
relu_2: MUST_SAVE  # blk1.sb0
detach_2: MUST_RECOMPUTE  # blk1.sb0
t_5: MUST_RECOMPUTE  # blk1.sb1
addmm_5: MUST_RECOMPUTE  # blk1.sb1
relu_3: MUST_SAVE  # blk1.sb1
detach_3: MUST_RECOMPUTE  # blk1.sb1
detach_4: MUST_RECOMPUTE  # blk1.sb1
t_16: MUST_RECOMPUTE  # blk1.sb1
detach_5: MUST_RECOMPUTE  # blk1.sb0
t_20: MUST_RECOMPUTE  # blk1.sb0
detach_6: MUST_RECOMPUTE  # blk0.sb1
t_24: MUST_RECOMPUTE  # blk0.sb1
detach_7: MUST_RECOMPUTE  # blk0.sb0
t_28: MUST_RECOMPUTE  # blk0.sb0""")


def test_tag_block_recompute_of_some_units_leaves_the_others_untagged(streamed):
    # Only (block 1, sub-batch 0) recomputes: block 0's nodes and block 1's other
    # sub-batch keep no tag but the fetched weights' own.
    joint = streamed().joint.graph
    assert_expected_inline(_tagged(joint, frozenset({(1, 0)})), """\
5 tagged
fetch_weight: MUST_RECOMPUTE  # blk0
fetch_weight_1: MUST_RECOMPUTE  # blk0
fetch_weight_2: MUST_RECOMPUTE  # blk1
fetch_weight_3: MUST_RECOMPUTE  # blk1
t_4: MUST_RECOMPUTE  # blk1.sb0
addmm_4: MUST_RECOMPUTE  # blk1.sb0
relu_2: MUST_SAVE  # blk1.sb0
detach_2: MUST_RECOMPUTE  # blk1.sb0
detach_5: MUST_RECOMPUTE  # blk1.sb0
t_20: MUST_RECOMPUTE  # blk1.sb0""")
