"""Pictures: the DOT of the compiled graphs, the Chrome trace, the memory plot, markers,
and the stream each transfer node names (drawn in the DOT, its lanes in the trace).

One tiny GPT (2 blocks, K=2, weights on nvme, aot_eager) is compiled and trained one
step for the whole module; a second step is recorded. The stream tests do the same
with weights, activations and weight gradients off the device.
"""

import copy
import json
import re
import shutil
import subprocess

import pydot
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import slcompile
from models import EXPECTED_SCHEDULE_K2_PER_SUBBATCH, GPTConfig, TinyGPT, make_gpt_batch
from slcompile.meta import SlcMeta, set_slc_meta
from slcompile.passes.annotate_streams import (
    COMM,
    COPY,
    INDUCTOR_STREAM_KEY,
    STREAM_KEY,
    annotate_streams,
    stream_key,
    transfer_stream,
)
from slcompile.passes.mark_regions import MARK, marked_regions
from slcompile.viz import dot as viz_dot
from slcompile.viz.dot import ROLE_COLORS, STREAM_COLORS, graph_digraph, graph_to_dot, render
from slcompile.units import format_bytes
from slcompile.viz.memory import device_layers, predict_live_bytes
from slcompile.viz.pictures import record_step, write_pictures
from slcompile.viz.roles import classify_nodes, transfer_nodes, transfer_role
from slcompile.vocabulary import is_fetch, is_fetch_issue, transfer_kind
from slcompile.viz.summary import summarize_schedule
from slcompile.viz.trace import chrome_trace, lane_stream, trace_lanes

CFG = GPTConfig(n_layers=2)
# The suffix per sub-batch: the drawings' split and combine boxes and per-sub-batch markers.
OPTIONS = {"lowering": "aot_eager", "num_subbatches": 2, "weights": "nvme", "suffix": "subbatches"}
PARAMS_PER_BLOCK = 12  # ln1, qkv, proj, ln2, fc, out: weight and bias each

pytestmark = pytest.mark.filterwarnings("ignore:'setParseAction' deprecated")  # pydot's own parser


@pytest.fixture(scope="module")
def compiled_step():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, 4)
    compiled = torch.compile(model, backend="speedloader", options=OPTIONS)

    def step():
        compiled(idx, targets)[1].backward()

    step()
    report = slcompile.compile_reports()[-1]
    recorded = record_step(step)
    return report, recorded


def _dot_nodes(graph: pydot.Dot):
    """name -> (attributes, enclosing cluster names), through nested clusters."""
    found = {}

    def walk(subgraph, clusters):
        for node in subgraph.get_nodes():
            name = node.get_name().strip('"')
            if name not in ("node", "edge", "graph"):
                found[name] = (node.get_attributes(), clusters)
        for child in subgraph.get_subgraphs():
            child_name = child.get_name().strip('"')
            walk(child, clusters + (child_name,) if child_name.startswith("cluster_") else clusters)

    walk(graph, ())
    return found


def test_schedule_text_and_summary(compiled_step):
    report, _ = compiled_step
    compute = [line for line in report.schedule.splitlines() if len(line.split()) == 2]
    assert compute == EXPECTED_SCHEDULE_K2_PER_SUBBATCH.splitlines()
    assert "fwd fetch.issue blk1\nfwd fetch.wait blk0\nfwd blk0.sb0" in report.schedule
    assert summarize_schedule(report.schedule) == (
        "fwd prefix.sb0-1 blk0.sb0-1 blk1.sb0-1 suffix.sb0-1\n"
        "bwd suffix.sb1-0 blk1.sb1-0 blk0.sb1-0 prefix.sb1-0"
    )


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_dot_holds_exactly_the_transfer_nodes(compiled_step, kind):
    report, _ = compiled_step
    gm = report.graphs[kind]
    transfers = transfer_nodes(gm)
    fetches = [n.name for n in gm.graph.nodes if is_fetch(n)]
    issues = [n.name for n in gm.graph.nodes if is_fetch_issue(n)]  # loads issued ahead
    assert issues and set(transfers) == set(fetches) | set(issues)
    if kind == "forward":
        assert len(fetches) == CFG.n_layers * PARAMS_PER_BLOCK
    (graph,) = pydot.graph_from_dot_data(graph_to_dot(gm, kind, detail="ops"))
    nodes = _dot_nodes(graph)
    highlighted = {name for name, (attrs, _) in nodes.items() if attrs.get("fillcolor", "").strip('"') == ROLE_COLORS["load"]}
    assert highlighted == set(transfers)
    for node in gm.graph.nodes:
        if node.name in fetches:  # drawn inside the block that fetches it
            block = classify_nodes(gm)[node.name].cluster
            assert nodes[node.name][1] == (f"cluster_{block}",)
    assert not any(name in nodes for name in (n.name for n in gm.graph.nodes if n.target is MARK))


def test_summary_dot_counts_every_transfer(compiled_step):
    report, _ = compiled_step
    gm = report.graphs["forward"]
    (graph,) = pydot.graph_from_dot_data(graph_to_dot(gm, "forward", detail="summary", block_paths=report.blocks))
    nodes = _dot_nodes(graph)
    loads = {name: attrs for name, (attrs, _) in nodes.items() if attrs.get("fillcolor", "").strip('"') == ROLE_COLORS["load"]}
    # Per block, one "load ×12" box of its fetches and one of the loads it issues ahead.
    assert len(loads) == 2 * CFG.n_layers
    listed = [member for attrs in loads.values() for member in attrs["tooltip"].strip('"').split()]
    assert sorted(listed) == sorted(transfer_nodes(gm))
    # One box per (block, sub-batch): far fewer nodes than ops.
    assert len(nodes) < len(gm.graph.nodes) / 5


def test_split_and_combine_are_recognised(compiled_step):
    report, _ = compiled_step
    roles = classify_nodes(report.graphs["forward"])
    splits = sorted(name for name, role in roles.items() if role.role == "split")
    combines = sorted(name for name, role in roles.items() if role.role == "combine")
    # idx and targets, each sliced once per sub-batch; the loss sum, the count and the logits cat.
    assert len(splits) == 2 * OPTIONS["num_subbatches"]
    assert all(roles[name].cluster.startswith("prefix.sb") for name in splits)
    assert len(combines) == 3 and all(roles[name].cluster == "suffix" for name in combines)


def test_render_writes_dot_text_without_the_dot_program(compiled_step, tmp_path, monkeypatch):
    report, _ = compiled_step
    monkeypatch.setattr(viz_dot.shutil, "which", lambda name: None)
    written = render(graph_to_dot(report.graphs["forward"], "forward", detail="summary"), tmp_path / "forward")
    assert written == [tmp_path / "forward.dot"]
    assert (tmp_path / "forward.dot").read_text().startswith("digraph")


@pytest.mark.skipif(shutil.which("dot") is None, reason="the Graphviz dot program is not installed")
def test_render_writes_svg_and_png(compiled_step, tmp_path):
    report, _ = compiled_step
    written = render(graph_to_dot(report.graphs["backward"], "backward", detail="summary"), tmp_path / "backward")
    assert [p.suffix for p in written] == [".dot", ".svg", ".png"]
    assert (tmp_path / "backward.png").read_bytes()[:4] == b"\x89PNG"


def test_markers_bracket_the_schedule(compiled_step):
    report, _ = compiled_step
    labels = [region.label for region in marked_regions(report.graphs["forward"].graph)]
    per_subbatch = [label.split(" ")[0] for label in labels if ".sb" in label]
    expected = [line.split(" ")[1] for line in report.schedule.splitlines() if line.startswith("fwd")
                and len(line.split()) == 2]
    assert per_subbatch == expected
    assert all(label.endswith(" fwd") for label in labels)
    assert [r.label for r in marked_regions(report.graphs["backward"].graph)][:3] == [
        "suffix bwd", "suffix.sb1 bwd", "suffix.sb0 bwd"
    ]


def test_slc_disable_leaves_graphs_unmarked(monkeypatch):
    monkeypatch.setenv("SLC_DISABLE", "mark_regions")
    idx, targets = make_gpt_batch(CFG, 4)
    compiled = torch.compile(TinyGPT(CFG), backend="speedloader", options={"lowering": "aot_eager"})
    compiled(idx, targets)[1].backward()
    for gm in slcompile.compile_reports()[-1].graphs.values():
        assert not any(node.target is MARK for node in gm.graph.nodes)


def test_trace_is_chrome_trace_json_with_one_event_per_transfer(compiled_step):
    report, recorded = compiled_step
    trace = json.loads(json.dumps(chrome_trace(recorded.events, report.graphs)))
    events = trace["traceEvents"]
    assert all({"ph", "pid", "name"} <= set(e) for e in events)
    lanes = trace_lanes(trace)
    assert lanes[1] == "compute" and "load" in lanes.values()
    slices = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and {"ts", "tid", "cat"} <= set(e) for e in slices)
    loads = [e for e in slices if e["cat"] == "load"]
    assert all(lanes[e["tid"]].startswith("load") for e in loads)
    assert len(loads) == sum(recorded.stats.transfers.values()) > 0
    assert sum(e["args"]["bytes"] for e in loads) == sum(recorded.stats.bytes_moved.values())
    assert {e["args"]["tier"] for e in loads} == {"nvme"}
    for lane in {lanes[e["tid"]] for e in loads}:  # no two slices of a lane overlap
        row = sorted((e["ts"], e["ts"] + e["dur"]) for e in loads if lanes[e["tid"]] == lane)
        assert all(end <= start + 1e-3 for (_, end), (start, _) in zip(row, row[1:]))
    computes = {e["name"] for e in slices if e["cat"] == "compute"}
    assert {"blk0.sb0 fwd", "blk1.sb1 bwd"} <= computes
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts and starts.keys() == finishes.keys()
    for flow_id, start in starts.items():
        assert any(s["tid"] == start["tid"] and s["ts"] <= start["ts"] <= s["ts"] + s["dur"] for s in loads)
        finish = finishes[flow_id]
        assert lanes[finish["tid"]] == "compute"
        assert any(s["tid"] == finish["tid"] and s["ts"] <= finish["ts"] <= s["ts"] + s["dur"] + 1e-3 for s in slices)


def test_predicted_live_bytes_of_a_small_graph():
    def f(x):
        doubled = x * 2  # 64 B
        flat = doubled.view(-1)  # a view: no memory of its own
        return flat + 1  # 64 B, the output

    gm = make_fx(f)(torch.ones(4, 4))
    (memory,) = predict_live_bytes({"forward": gm})
    live = dict(zip(memory.nodes, memory.other))
    assert [n.name for n in gm.graph.nodes] == ["x_1", "mul", "view", "add", "output"]
    assert (live["x_1"], live["mul"], live["view"], live["add"], live["output"]) == (0, 64, 64, 128, 64)
    assert memory.peak == 128 and set(memory.weights) == {0}


def test_predicted_fetched_weights_live_only_inside_their_block(compiled_step):
    report, _ = compiled_step
    gm = report.graphs["forward"]
    memory, backward = predict_live_bytes(report.graphs)
    assert (memory.phase, backward.phase) == ("fwd", "bwd")
    roles = classify_nodes(gm)
    block_weights = sum(
        n.meta["val"].numel() * 4 for n in gm.graph.nodes if n.target is torch.ops.slc.fetch_weight.default
    ) // CFG.n_layers
    assert max(memory.weights) == block_weights
    for name, weights in zip(memory.nodes, memory.weights):
        cluster = roles[name].cluster or ""
        if cluster.startswith(("prefix", "suffix")):
            assert weights == 0, name


def test_write_pictures(compiled_step, tmp_path):
    report, recorded = compiled_step
    written = write_pictures(tmp_path, report, recorded, detail="summary")
    assert set(written) >= {"schedule", "forward", "backward", "trace", "timeline", "memory"}
    for paths in written.values():
        for path in paths:
            assert path.exists() and path.stat().st_size > 0
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert recorded.samples and {"device", "nvme"} <= set(recorded.samples[0].resident)


def test_memory_plot_of_a_step_whose_transfers_were_coalesced(compiled_step, tmp_path):
    """Under Inductor the compiled graphs hold runs of transfers as one `_many` call
    (`coalesce_transfers`), while the memory model names the single transfers: the
    plot places each node the compiled graph lacks at the node before it."""
    from slcompile.passes.coalesce_transfers import coalesce_transfers

    report, recorded = compiled_step
    coalesced = copy.copy(report)
    coalesced.graphs = {kind: coalesce_transfers(copy.deepcopy(gm))[0] for kind, gm in report.graphs.items()}
    compiled_names = {node.name for gm in coalesced.graphs.values() for node in gm.graph.nodes}
    assert any(name not in compiled_names for _, nodes in device_layers(report.memory).graphs for name in nodes)
    written = write_pictures(tmp_path, coalesced, recorded, ("plot",))
    assert written["memory"][0].read_bytes()[:4] == b"\x89PNG"


def test_memory_plot_peaks_at_the_device_peak_explain_prints(compiled_step):
    report, _ = compiled_step
    layers = device_layers(report.memory)
    assert layers.peak == report.memory.peak_bytes["device"]
    assert min(layers.held) >= report.memory.held_bytes > 0 and max(layers.weights) > 0
    torch.manual_seed(0)
    idx, targets = make_gpt_batch(CFG, 4)
    explanation = slcompile.explain(TinyGPT(CFG), idx, targets, **OPTIONS)
    assert explanation.predicted_peak_bytes["device"] == layers.peak
    assert format_bytes(layers.peak) in str(explanation)


# -- streams: each transfer names the stream it runs on ------------------------------

OFFLOADED = {"lowering": "aot_eager", "num_subbatches": 2, "weights": "nvme", "activations": "nvme",
             "min_offload_bytes": 0}


@pytest.fixture(scope="module")
def offloaded_step():
    """Weights, saved activations and weight gradients all leave the device: every
    kind of transfer is in the graphs; one step trained, a second one recorded."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    eager = copy.deepcopy(model)
    opt = slcompile.offload_optimizer(model, torch.optim.SGD, states="host", gradients="nvme", lr=0.1)
    idx, targets = make_gpt_batch(CFG, 4)
    compiled = torch.compile(model, backend="speedloader", options=OFFLOADED)

    def step():
        loss = compiled(idx, targets)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    torch.testing.assert_close(step(), eager(idx, targets)[1].detach())
    report = slcompile.compile_reports()[-1]
    recorded = record_step(step)
    opt.close()
    return report, recorded


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_every_transfer_and_no_compute_node_names_a_stream(offloaded_step, kind):
    report, _ = offloaded_step
    gm = report.graphs[kind]
    kinds = set()
    for node in gm.graph.nodes:
        custom = node.meta.get("custom") or {}
        if transfer_kind(node) is None:
            assert STREAM_KEY not in custom and transfer_stream(node) is None, node.format_node()
            continue
        kinds.add(transfer_kind(node))
        assert custom[STREAM_KEY] == transfer_stream(node) == COPY, node.format_node()
        if transfer_kind(node) == ("store_grad", "issue"):
            assert transfer_role(node) == "store"  # drawn as the store it is
    expected = {"forward": {"fetch", "stash"}, "backward": {"fetch", "unstash", "store_grad"}}[kind]
    assert kinds == {(what, half) for what in expected for half in ("issue", "wait")}
    # The slc tags AOTAutograd carried stay beside the stream.
    assert any("slc" in n.meta["custom"] for n in gm.graph.nodes if transfer_kind(n) is not None)


def test_streams_follow_sharding_and_keep_the_tag_under_inductor():
    from slcompile.vocabulary import FETCH_ISSUE, FETCH_WEIGHT, OFFLOAD_GRAD, STASH, WAIT

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    issue = graph.call_function(FETCH_ISSUE, ("w0|w0:fc_weight",))
    fetch = graph.call_function(FETCH_WEIGHT, (x, "w0|w0:fc_weight"))
    y = graph.call_function(torch.ops.aten.mul.Tensor, (fetch, x))
    stash = graph.call_function(STASH, (y, "a0|blk0.sb0.mul"))
    stash_wait = graph.call_function(WAIT, (stash, [y]))
    store = graph.call_function(OFFLOAD_GRAD, (y, "g0|w0:fc_weight"))
    store_wait = graph.call_function(WAIT, (store, [y]))
    graph.output(y)
    for node in (fetch, y, stash):
        set_slc_meta(node, SlcMeta("block", 0, 0))
    counts = annotate_streams(graph, key=stream_key("inductor"), sharded_weights=True, sharded_gradients=True)
    assert counts == {COMM: 4, COPY: 2}
    streams = {node: transfer_stream(node) for node in graph.nodes}
    assert [streams[n] for n in (issue, fetch, store, store_wait)] == [COMM] * 4
    assert [streams[n] for n in (stash, stash_wait)] == [COPY] * 2
    assert streams[y] is None and streams[x] is None
    # Inductor acts on "stream" (see annotate_streams): its graphs carry slcompile's key.
    assert not any(STREAM_KEY in (n.meta.get("custom") or {}) for n in graph.nodes)
    assert fetch.meta["custom"] == {"slc": "blk0.sb0", INDUCTOR_STREAM_KEY: COMM}
    assert y.meta["custom"] == {"slc": "blk0.sb0"}


def _node_statements(digraph) -> dict[str, str]:
    """Node name -> its DOT statement (one entry of the digraph's body each), quicker
    than parsing a graph of a thousand nodes back."""
    found = {}
    for line in digraph.body:
        match = re.match(r'\s*"?([\w.]+)"? \[', line)
        if match and "->" not in line and match.group(1) not in ("graph", "node", "edge"):
            found[match.group(1)] = line
    return found


@pytest.mark.parametrize("detail", ["ops", "summary"])
def test_dot_outlines_transfers_in_their_stream_colour(offloaded_step, detail):
    report, _ = offloaded_step
    gm = report.graphs["backward"]
    digraph = graph_digraph(gm, "backward", detail=detail)
    outline = f' color="{STREAM_COLORS[COPY]}"'
    statements = _node_statements(digraph)
    outlined = {name for name, statement in statements.items() if outline in statement}
    transfers = {n.name for n in gm.graph.nodes if transfer_kind(n) is not None}
    if detail == "ops":
        assert outlined == transfers
    else:  # every box of transfers, and only those
        members = {m for name in outlined for m in re.search(r'tooltip="([^"]*)"', statements[name]).group(1).split()}
        assert members == transfers and len(outlined) < len(transfers) / 5
    legend = digraph.graph_attr["label"]
    assert f'<td border="2" color="{STREAM_COLORS[COPY]}"> {COPY}: ' in legend and "default: compute" in legend
    assert STREAM_COLORS[COMM] not in digraph.source  # no transfer runs there


def test_trace_puts_each_streams_lanes_in_its_process(offloaded_step):
    report, recorded = offloaded_step
    trace = chrome_trace(recorded.events, report.graphs)
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert processes == {1: "slcompile default stream", 2: f"slcompile {COPY} stream"}
    lanes = trace_lanes(trace)
    pid_of = {e["tid"]: e["pid"] for e in events if e.get("name") == "thread_name"}
    default_lanes = {lanes[tid] for tid, pid in pid_of.items() if pid == 1}
    assert "compute" in default_lanes and all(lane.startswith("compute") for lane in default_lanes)
    copy_lanes = {lanes[tid] for tid, pid in pid_of.items() if pid == 2}
    assert {"load", "store"} <= copy_lanes and all(lane.startswith(("load", "store")) for lane in copy_lanes)
    # The graphs' streams are the trace's: every transfer slice lies in its stream's process.
    annotated = {transfer_stream(n) for gm in report.graphs.values() for n in gm.graph.nodes} - {None}
    slices = [e for e in events if e["ph"] == "X"]
    transfers = [e for e in slices if e["cat"] in ("load", "store")]
    assert {e["cat"] for e in transfers} == {"load", "store"}
    assert {e["args"]["stream"] for e in transfers} == annotated == {COPY}
    assert all(pid_of[e["tid"]] == e["pid"] == 2 for e in transfers)
    assert all(e["pid"] == 1 for e in slices if e["cat"] == "compute")
    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert flows and all(e["pid"] == pid_of[e["tid"]] for e in flows)
    assert trace["otherData"]["streams"] == {lane: lane_stream(lane) for lane in trace["otherData"]["lanes"]}


def test_trace_puts_collectives_in_the_comm_streams_process():
    from slcompile.runtime.stats import TimelineEvent

    events = [TimelineEvent("compute", 0.0, 2e-3, 0, "blk0.sb0 fwd"),
              TimelineEvent("load", 0.0, 1e-3, 4096, "weight w0:fc nvme->device"),
              TimelineEvent("collective", 1e-3, 1.5e-3, 4096, "all_gather w0|w0:fc")]
    trace = chrome_trace(events)
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert processes == {1: "slcompile default stream", 2: "slcompile copy stream", 3: "slcompile comm stream"}
    slices = {e["cat"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert [(slices[c]["pid"], slices[c]["args"].get("stream")) for c in ("compute", "load", "collective")] == [
        (1, None), (2, COPY), (3, COMM)]
    assert trace["otherData"]["streams"] == {"compute": "default", "load": COPY, "collective": COMM}


def test_summary_writes_alternating_subbatches_as_one_interleaved_run():
    schedule = "\n".join(f"bwd suffix.sb{sb}" for sb in (3, 0, 3, 0, 3, 2, 1, 0)) + "\nbwd blk1.sb3\nbwd blk1.sb2"
    assert summarize_schedule(schedule) == "bwd suffix.sb0-3 interleaved (8 steps) blk1.sb3-2"
    assert summarize_schedule("fwd blk0.sb0\nfwd blk0.sb2") == "fwd blk0.sb0,2"


def test_timeline_colours_each_kind_of_transfer(tmp_path, monkeypatch):
    from matplotlib.colors import to_hex

    from slcompile.runtime.stats import TimelineEvent
    from slcompile.viz import plots

    events = [TimelineEvent("compute", 0.0, 4e-3, 0, "blk0.sb0 fwd"),
              TimelineEvent("load", 0.0, 1e-3, 4096, "weight w0:fc nvme->device"),
              TimelineEvent("store", 1e-3, 2e-3, 2048, "activation a0|blk0.sb0.x device->nvme"),
              TimelineEvent("load", 2e-3, 3e-3, 2048, "activation a0|blk0.sb0.x nvme->device"),
              TimelineEvent("store", 3e-3, 4e-3, 4096, "gradient g0|w0:fc device->host"),
              TimelineEvent("load", 3e-3, 4e-3, 8192, "optimizer_state s0 nvme->host")]
    drawn = {}
    real = plots._draw_lanes

    def spy(axis, trace, title, end):
        kinds = real(axis, trace, title, end)
        drawn[title] = {to_hex(c.get_facecolor()[0]) for c in axis.collections}
        return kinds

    monkeypatch.setattr(plots, "_draw_lanes", spy)
    trace = chrome_trace(events)
    path = plots.plot_timelines(tmp_path / "timelines.png", {"a": trace, "b": trace})
    assert path.stat().st_size > 0 and list(drawn) == ["a", "b"]
    kinds = ("weight", "activation", "gradient", "optimizer_state")
    assert len({plots.TRANSFER_COLORS[k] for k in kinds}) == 4
    assert {plots.TRANSFER_COLORS[k] for k in kinds} <= drawn["a"]


def test_timelines_share_one_time_axis(tmp_path, monkeypatch):
    from slcompile.runtime.stats import TimelineEvent
    from slcompile.viz import plots

    def trace(seconds):
        return chrome_trace([TimelineEvent("compute", 0.0, seconds, 0, "blk0.sb0 fwd"),
                             TimelineEvent("load", 0.0, seconds / 2, 4096, "weight w0:fc nvme->device")])

    axes = {}
    real = plots._draw_lanes

    def spy(axis, trace, title, end):
        axes[title] = axis
        return real(axis, trace, title, end)

    monkeypatch.setattr(plots, "_draw_lanes", spy)
    plots.plot_timelines(tmp_path / "timelines.png", {"short": trace(2e-3), "long": trace(8e-3)})
    short, long = axes["short"], axes["long"]
    assert short.get_shared_x_axes().joined(short, long)
    assert short.get_xlim() == long.get_xlim() == (0.0, 8.0)


@pytest.fixture(scope="module")
def zigzag_spilling_step():
    """Two blocks, K=4, the zigzag order with spilled block outputs: block 1 runs
    sub-batches 3, 2, 1, 0."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, 8)
    options = dict(OPTIONS, num_subbatches=4, schedule="zigzag_spilling", activations="nvme", min_offload_bytes=0)
    compiled = torch.compile(model, backend="speedloader", options=options)

    def step():
        compiled(idx, targets)[1].backward()

    step()
    report = slcompile.compile_reports()[-1]
    return report, record_step(step)


def _first_runs(schedule: str, phase: str) -> dict[str, list[str]]:
    """Per region (`blk1`), its sub-batch tags in the order the schedule first runs them."""
    runs: dict[str, list[str]] = {}
    for line in schedule.splitlines():
        match = re.fullmatch(rf"{phase} ((?:blk\d+|prefix|suffix)\.sb\d+)", line)
        if match and match[1] not in runs.setdefault(match[1].split(".")[0], []):
            runs[match[1].split(".")[0]].append(match[1])
    return runs


@pytest.mark.parametrize("detail", ["ops", "summary"])
def test_dot_places_subbatch_boxes_in_run_order_one_rank_after_another(zigzag_spilling_step, detail):
    report, _ = zigzag_spilling_step
    runs = _first_runs(report.schedule, "fwd")
    assert runs["blk0"] == ["blk0.sb0", "blk0.sb1", "blk0.sb2", "blk0.sb3"]
    assert runs["blk1"] == ["blk1.sb3", "blk1.sb2", "blk1.sb1", "blk1.sb0"]
    source = graph_to_dot(report.graphs["forward"], "forward", detail, report.blocks)
    graph = pydot.graph_from_dot_data(source)[0]
    nodes = _dot_nodes(graph)
    # No rank=same group: dot reorders within a rank; only ranks keep an order.
    assert "rank=same" not in source
    invisible = {(e.get_source().strip('"'), e.get_destination().strip('"')) for e in graph.get_edges()
                 if e.get_attributes().get("style") == "invis"}
    for region, tags in runs.items():
        written = [tag for tag in re.findall(r'subgraph "cluster_([\w.]+)"', source) if tag.split(".")[0] == region]
        assert written == tags
        firsts = [next(name for name, (_, clusters) in nodes.items() if clusters[-1] == f'cluster_{tag}')
                  for tag in tags]
        assert all((before, after) in invisible for before, after in zip(firsts, firsts[1:])), (region, firsts)
    labels = re.findall(r'label="(sb\d · runs \d/\d)"', source)
    assert labels[4:8] == ["sb0 · runs 1/4", "sb1 · runs 2/4", "sb2 · runs 3/4", "sb3 · runs 4/4"]
    assert labels[8:12] == ["sb3 · runs 1/4", "sb2 · runs 2/4", "sb1 · runs 3/4", "sb0 · runs 4/4"]
    if viz_dot.dot_available():  # and dot lays them out so
        layout = subprocess.run(["dot", "-Tplain"], input=source, capture_output=True, text=True, check=True).stdout
        position = {p[1]: (float(p[2]), -float(p[3])) for p in map(str.split, layout.splitlines()) if p[0] == "node"}
        axis = 0 if detail == "summary" else 1
        for tags in runs.values():
            firsts = [next(name for name, (_, clusters) in nodes.items() if clusters[-1] == f'cluster_{tag}')
                      for tag in tags]
            assert [position[name][axis] for name in firsts] == sorted(position[name][axis] for name in firsts)


@pytest.mark.parametrize("detail", ["ops", "summary"])
def test_spills_and_fills_say_whose_output_they_move(zigzag_spilling_step, detail):
    report, _ = zigzag_spilling_step
    source = graph_to_dot(report.graphs["forward"], "forward", detail, report.blocks)
    owners = {step: set(re.findall(rf"\b{step} of ((?:blk\d+|prefix)\.sb\d+) output", source))
              for step in ("spill", "fill")}
    assert owners["spill"] and owners["spill"] == owners["fill"]
    # Every spilled sub-batch's output, and only those: the schedule's spill steps name them.
    assert owners["spill"] == set(re.findall(r"^fwd spill\.issue ([\w.]+)$", report.schedule, flags=re.M))
    # A stash of a saved activation is still a stash.
    assert "spill of" not in re.sub(r"spill of [\w.]+ output", "", source)


def test_timeline_title_names_the_policy_and_k(zigzag_spilling_step, tmp_path, monkeypatch):
    from slcompile.viz import plots

    report, recorded = zigzag_spilling_step
    titles = []
    real = plots._draw_lanes

    def spy(axis, trace, title, end):
        titles.append(title)
        return real(axis, trace, title, end)

    monkeypatch.setattr(plots, "_draw_lanes", spy)
    written = write_pictures(tmp_path, report, recorded, ("trace",))
    assert written["timeline"][0].stat().st_size > 0
    assert titles == ["timeline of one training step, policy zigzag_spilling, K=4"]


def test_predicted_timeline_is_written_as_a_chrome_trace_and_a_picture(tmp_path):
    tiny = GPTConfig(n_layers=2, d_model=32)
    idx, targets = make_gpt_batch(tiny, 4)
    explanation = slcompile.explain(TinyGPT(tiny), idx, targets, num_subbatches=2, weights="nvme",
                                    activations="nvme", min_offload_bytes=0, lowering="aot_eager",
                                    profile="h100-pcie5-nvme")
    prediction = explanation.time
    written = explanation.write_predicted_timeline(tmp_path)
    assert written["predicted_trace"] == [tmp_path / "predicted_trace.json"]
    assert written["predicted_timeline"] == [tmp_path / "predicted_timeline.png"]
    assert (tmp_path / "predicted_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((tmp_path / "predicted_trace.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    # One slice per predicted event, in order, on one lane (tid) per lane of the prediction.
    assert len(slices) == len(prediction.events)
    lanes = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert sorted(lanes.values()) == sorted({event.lane for event in prediction.events})
    assert [lanes[s["tid"]] for s in slices] == [event.lane for event in prediction.events]
    assert {event.lane for event in prediction.events} >= {"compute", "disk"}
    for slice_, event in zip(slices, prediction.events):
        assert slice_["dur"] == pytest.approx(event.seconds * 1e6, abs=1e-3)
        assert slice_["ts"] == pytest.approx(event.start * 1e6, abs=1e-3)
    # Per lane, the busy microseconds are the prediction's, and no two slices overlap.
    for tid, lane in lanes.items():
        mine = sorted((s["ts"], s["ts"] + s["dur"]) for s in slices if s["tid"] == tid)
        assert all(end <= start + 1e-6 for (_, end), (start, _) in zip(mine, mine[1:]))
    busy = {lane: sum(s["dur"] for s in slices if s["tid"] == tid and s["cat"] != "stall")
            for tid, lane in lanes.items()}
    # (Each slice is rounded to the nanosecond: a lane's sum within that per slice.)
    assert busy == pytest.approx({lane: seconds * 1e6 for lane, seconds in prediction.lane_seconds().items()},
                                 abs=1e-3 * len(slices))
    # Transfers carry the measured trace's categories and bytes.
    fetches = [s for s in slices if s["args"].get("transfer") == "fetch"]
    assert fetches and all(s["cat"] == "load" and s["args"]["kind"] == "weight" for s in fetches)
    stashes = [s for s in slices if s["args"].get("transfer") == "stash"]
    assert stashes and all(s["cat"] == "store" and s["args"]["kind"] == "activation" for s in stashes)
    assert sum(s["args"]["bytes"] for s in fetches) == sum(e.nbytes for e in prediction.events if e.kind == "fetch")
    assert trace["otherData"]["predicted"] and trace["otherData"]["profile"] == "h100-pcie5-nvme"
    with pytest.raises(ValueError, match="no predicted timeline to write"):
        slcompile.explain(TinyGPT(tiny), idx, targets, num_subbatches=2, lowering="aot_eager",
                          profile=None).write_predicted_timeline(tmp_path / "none")
