"""annotate_streams alone on the partitioned graphs of a two-block MLP whose block
weights are fetched: every transfer node names the copy stream (the communication
stream when the weights are sharded), compute nodes name none."""

from expecttest import assert_expected_inline

from slcompile.passes.annotate_streams import (
    INDUCTOR_STREAM_KEY,
    STREAM_KEY,
    annotate_streams,
    stream_key,
    transfer_stream,
)
from slcompile.passes.stream_weights import place_prefetches


def test_annotate_streams_names_the_stream_of_every_transfer(streamed):
    graphs = streamed()
    place_prefetches(graphs.forward, graphs.backward, live_blocks=2)
    lines = []
    for kind, gm in (("forward", graphs.forward), ("backward", graphs.backward)):
        annotated = annotate_streams(gm, key=stream_key("aot_eager"))
        lines.append(f"{kind}: {annotated.text()}")
        lines += [f"  {node.name}: {node.meta['custom']}" for node in gm.graph.nodes if transfer_stream(node)]
    assert_expected_inline("\n".join(lines), """\
forward: copy: 7 nodes
  fetch_issue_default: {'slc': 'blk0', 'stream': 'copy'}
  fetch_issue_default_1: {'slc': 'blk0', 'stream': 'copy'}
  fetch_weight: {'slc': 'blk0', 'stream': 'copy'}
  fetch_weight_1: {'slc': 'blk0', 'stream': 'copy'}
  fetch_issue_default_2: {'slc': 'blk1', 'stream': 'copy'}
  fetch_weight_2: {'slc': 'blk1', 'stream': 'copy'}
  fetch_weight_3: {'slc': 'blk1', 'stream': 'copy'}
backward: copy: 5 nodes
  fetch_issue_default: {'slc': 'blk1', 'stream': 'copy'}
  fetch_weight_2: {'slc': 'blk1', 'stream': 'copy'}
  fetch_issue_default_1: {'slc': 'blk0', 'stream': 'copy'}
  fetch_issue_default_2: {'slc': 'blk0', 'stream': 'copy'}
  fetch_weight: {'slc': 'blk0', 'stream': 'copy'}""")
    assert stream_key("aot_eager") == STREAM_KEY


def test_annotate_streams_under_inductor_and_sharded_weights(streamed):
    graphs = streamed()
    annotated = annotate_streams(graphs.forward, key=stream_key("inductor"), sharded_weights=True)
    streams = {node.name: node.meta["custom"] for node in graphs.forward.graph.nodes if transfer_stream(node)}
    assert_expected_inline(f"{annotated.text()}\n{streams}", """\
comm: 4 nodes
{'fetch_weight': {'slc': 'blk0', 'slc_stream': 'comm'}, 'fetch_weight_1': {'slc': 'blk0', 'slc_stream': 'comm'}, 'fetch_weight_2': {'slc': 'blk1', 'slc_stream': 'comm'}, 'fetch_weight_3': {'slc': 'blk1', 'slc_stream': 'comm'}}""")
    assert stream_key("inductor") == INDUCTOR_STREAM_KEY
