"""schedule_of (the derive_schedule pass) alone on the partitioned graphs of a
two-block MLP: the schedule read back from the graphs, transfers included, in its one
text form."""

from expecttest import assert_expected_inline

from models import EXPECTED_SCHEDULE_K2_PER_SUBBATCH
from slcompile.passes.stream_weights import place_prefetches
from slcompile.schedules.derive import schedule_of


def test_schedule_of_reads_the_layer_major_order(partitioned):
    forward, backward, _ = partitioned()
    # Layer-major: each block once for all sub-batches, as every 2-block model at K=2.
    assert schedule_of(forward, backward).text() == EXPECTED_SCHEDULE_K2_PER_SUBBATCH


def test_schedule_of_reads_fetches_and_their_issues(streamed):
    graphs = streamed()
    place_prefetches(graphs.forward, graphs.backward, live_blocks=2)
    assert_expected_inline(schedule_of(graphs.forward, graphs.backward).text(), """\
fwd prefix.sb0
fwd prefix.sb1
fwd fetch.issue blk1
fwd fetch.wait blk0
fwd blk0.sb0
fwd blk0.sb1
fwd fetch.issue blk1@bwd
fwd fetch.wait blk1
fwd blk1.sb0
fwd blk1.sb1
fwd suffix.sb0
fwd suffix.sb1
bwd suffix.sb1
bwd suffix.sb0
bwd blk1.sb1
bwd fetch.issue blk0
bwd fetch.wait blk1
bwd blk1.sb0
bwd blk0.sb1
bwd fetch.issue blk0@fwd
bwd fetch.wait blk0
bwd blk0.sb0
bwd prefix.sb1
bwd prefix.sb0""")


def test_schedule_of_an_inference_graph_has_a_forward_only(streamed):
    graphs = streamed()
    assert_expected_inline(schedule_of(graphs.forward).text(), """\
fwd prefix.sb0
fwd prefix.sb1
fwd fetch.wait blk0
fwd blk0.sb0
fwd blk0.sb1
fwd fetch.wait blk1
fwd blk1.sb0
fwd blk1.sb1
fwd suffix.sb0
fwd suffix.sb1""")
