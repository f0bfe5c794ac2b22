"""The op vocabulary: one format and one parser per key, one answer to "does this
node compute", and graphs built with the ops without the runtime."""

import ast
import pathlib

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import slcompile
from slcompile.vocabulary import (
    FETCH_ISSUE,
    FETCH_WEIGHT,
    OFFLOAD_GRAD,
    STASH,
    UNSTASH,
    UNSTASH_WAIT,
    WAIT,
    StashKey,
    WeightKey,
    is_bookkeeping,
    is_compute,
    is_fetch,
    is_issue,
    is_load,
    is_store,
    is_wait,
    issued_visit,
    parse_region_label,
    prefetch_ahead,
    prefetched_visits,
    region_label,
    transfer_kind,
)


@pytest.mark.parametrize("key", [
    WeightKey("w3", "w0:layers_0_fc_weight"),
    WeightKey("w3", "w0:layers_0_fc_weight", subbatch=1, phase="bwd"),
])
def test_weight_keys_round_trip(key):
    assert WeightKey.parse(key.format()) == key


def test_weight_key_text_and_bad_keys():
    assert WeightKey("w3", "w0:name", 1, "bwd").format() == "w3|w0:name#sb1@bwd"
    assert WeightKey.parse("w3|w0:name") == WeightKey("w3", "w0:name", None, "fwd")
    for bad in ("w0:name", "w3|w0:name@sideways", "w3|"):
        with pytest.raises(ValueError, match="not a weight key"):
            WeightKey.parse(bad)
    assert StashKey.parse(StashKey("a2", "blk3.sb1.mul_4").format()) == StashKey("a2", "blk3.sb1.mul_4")
    with pytest.raises(ValueError, match="not a stash key"):
        StashKey.parse("blk3.sb1")


def test_predicates_on_a_traced_graph():
    def f(x, w):
        fetched = torch.ops.slc.fetch_weight(w, "w0|w0:w@fwd")
        return (x @ fetched.t()).relu().view(-1)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(2, 4), torch.randn(3, 4))  # fake: no runtime needed
    by_name = {n.name: n for n in gm.graph.nodes}
    (fetch,) = [n for n in gm.graph.nodes if is_fetch(n)]
    assert is_load(fetch) and is_wait(fetch) and transfer_kind(fetch) == ("fetch", "wait")
    assert not is_compute(fetch)
    computing = [n.name for n in gm.graph.nodes if is_compute(n)]
    assert [by_name[n].target for n in computing] == [torch.ops.aten.mm.default, torch.ops.aten.relu.default]


def test_issue_store_and_wait_cover_every_transfer_gradient_stores_included():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    fetch_issue = graph.call_function(FETCH_ISSUE, ("w0|w0:w@fwd",))
    fetch = graph.call_function(FETCH_WEIGHT, (x, "w0|w0:w@fwd"))
    stash = graph.call_function(STASH, (x, "a0|blk0.sb0.x"))
    stash_wait = graph.call_function(WAIT, (stash, [x]))
    unstash = graph.call_function(UNSTASH, (stash,))
    unstash_wait = graph.call_function(UNSTASH_WAIT, (unstash, [2], torch.float32, torch.device("cpu")))
    store_grad = graph.call_function(OFFLOAD_GRAD, (x, "g0|w0:w"))
    store_grad_wait = graph.call_function(WAIT, (store_grad, [x]))
    relu = graph.call_function(torch.ops.aten.relu.default, (x,))
    view = graph.call_function(torch.ops.aten.view.default, (relu, [-1]))
    nodes = {n.name: n for n in graph.nodes if n.op == "call_function"}
    table = {name: (is_issue(n), is_wait(n), is_store(n), is_load(n)) for name, n in nodes.items()}
    assert table == {
        fetch_issue.name: (True, False, False, False),
        fetch.name: (False, True, False, True),
        stash.name: (True, False, True, False),
        stash_wait.name: (False, True, False, False),
        unstash.name: (True, False, False, False),
        unstash_wait.name: (False, True, False, True),
        store_grad.name: (True, False, True, False),
        store_grad_wait.name: (False, True, False, False),
        relu.name: (False, False, False, False),
        view.name: (False, False, False, False),
    }
    assert transfer_kind(store_grad_wait) == ("store_grad", "wait")
    assert [n.name for n in nodes.values() if is_bookkeeping(n)] == [view.name]
    assert [n.name for n in nodes.values() if is_compute(n)] == [relu.name]


def test_region_labels_round_trip():
    assert region_label("blk3.sb1", "fwd") == "blk3.sb1 fwd"
    assert parse_region_label(region_label("blk3.sb1", "bwd")) == ("blk3.sb1", "bwd")
    assert parse_region_label("suffix") == ("suffix", "")


def test_one_prefetch_rule_around_the_cycle_of_visits():
    # Four visits (two blocks forward, then backward), two blocks' weights live.
    assert [issued_visit(v, 2, 4) for v in range(4)] == [1, 2, 3, 0]
    assert [prefetched_visits(v, 2, 4) for v in (-1, 0, 3)] == [(0,), (1,), (0,)]
    assert [issued_visit(v, 3, 4) for v in range(4)] == [2, 3, 0, 1]
    assert prefetched_visits(1, 3, 4) == (2, 3)
    # At most the other visits; none with one live block or no visit.
    assert prefetch_ahead(9, 4) == 3 and prefetch_ahead(1, 4) == 0 and prefetch_ahead(2, 0) == 0
    assert issued_visit(0, 1, 4) is None and prefetched_visits(0, 1, 4) == () == prefetched_visits(-1, 2, 0)


# The runtime's records of a step, and the hook that samples them at region markers.
VIZ_MAY_READ = ("slcompile.runtime.stats.", "slcompile.runtime.ops.set_region_listener")


def test_passes_analyses_and_schedules_never_import_the_runtime():
    """They learn what an op is from the vocabulary and what they need of the
    machine and the process from plain records the backend makes
    (`ProcessFacts`); the runtime is reached only through the ops the graphs call,
    and the plans name its objects without making them. Compiling's stages never
    import the backend that runs them. (Pictures may read the runtime's records.)"""
    package = pathlib.Path(slcompile.__file__).parent
    found = []
    for folder in ("passes", "analysis", "schedules", "viz", "plans.py", "kv_segments.py", "pipeline.py"):
        for path in [package / folder] if folder.endswith(".py") else sorted((package / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                for name in names:
                    allowed = folder == "viz" and name.startswith(VIZ_MAY_READ)
                    if name.startswith(("slcompile.runtime", "slcompile.backends")) and not allowed:
                        found.append(f"{path.relative_to(package)}: {name}")
    assert found == [], found


def test_a_visits_weights_pack_one_tensor_a_dtype_each_on_a_16_byte_boundary():
    from slcompile.vocabulary import packing_order, weight_layout

    layout = weight_layout([((5,), torch.float32), ((3,), torch.bfloat16), ((6, 5), torch.float32)])
    assert layout.sections == ((torch.float32, 38), (torch.bfloat16, 3))
    assert layout.places == ((0, 0), (1, 0), (0, 8))  # 5 floats end at 20 bytes; the next starts at 32
    # By key, then the first dtype among them first.
    members = [("b", torch.float32), ("a", torch.bfloat16), ("c", torch.float32), ("d", torch.bfloat16)]
    assert packing_order(members) == [1, 3, 0, 2]
