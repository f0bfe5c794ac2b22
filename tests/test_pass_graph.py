"""One generation pass lowered to an FX graph (`slcompile.inference.pass_graph`),
alone: its nodes follow the schedule's steps in order, each transfer an `slc::` op's
implementation, and each value's last use is the step where the memory model lets it
go. The same graphs run end to end (tokens equal eager, bytes, peaks) in
test_generate.py."""

import pytest
import torch

from slcompile.inference.pass_graph import PassLayout, lower_pass
from slcompile.runtime import activations, ops, weights
from slcompile.schedules.base import Schedule
from slcompile.schedules.generation import PassRequest, generation_pass

# Layer 0 has a streamed weight and a buffer; layer 1 a weight that stays resident.
LAYOUT = PassLayout(((0, 0, 2), (1, 2, 2), (2, 4, 2)),
                    ((("w", torch.zeros(2), "w0|blk0.w"), ("b", torch.zeros(2), None)),
                     (("w", torch.zeros(2), None),)),
                    stash="a0")


def _lines(graph: torch.fx.Graph) -> list[str]:
    """Each call of the graph as `name = function(arguments)`, without the call
    (`run`) and the item and attribute reads."""
    lines = []
    for node in graph.nodes:
        name = getattr(node.target, "__name__", str(node.target))
        if node.op in ("placeholder", "get_attr", "output") or name in ("getitem", "getattr"):
            continue
        args = ", ".join(a.name if isinstance(a, torch.fx.Node) else repr(a) for a in node.args
                         if not (isinstance(a, torch.fx.Node) and a.name == "run"))
        lines.append(f"{node.name} = {name}({args})")
    return lines


def _last_uses(graph: torch.fx.Graph) -> dict[str, str]:
    """Each value's last user, where FX's generated code drops it."""
    last = {}
    for node in graph.nodes:
        for used in node.all_input_nodes:
            last[used.name] = node.name
    return last


def test_an_offloading_prefill_is_its_schedules_steps_in_order_with_the_ops_of_training_graphs():
    request = PassRequest("prefill", (0, 1, 2), fetched=(True, False), kv_moves=True, stores=True, rows=(2, 2),
                          spill_hidden=True)
    graph = lower_pass(generation_pass(request), LAYOUT).graph
    assert _lines(graph) == [
        "fetch_issue_default = fetch_issue('w0|blk0.w')",
        "fetch_weight_default = fetch_weight(blk0_w, 'w0|blk0.w')",
        "w_blk0 = layer_weights(('w', 'b'), fetch_weight_default, blk0_b)",
        "capture_part = capture_part(inputs, 0, 2, 6, 0)",
        "blk0_sb0 = layer_step('prefill', 0, 0, w_blk0, h_blk0_sb0, getitem)",
        "cache_layout = cache_layout(getitem_1, out_blk0_sb0)",
        "collect = collect(new_cache, 0, 0, 0, getitem_1, getitem_2, getitem_3)",
        "store = store(new_cache, 0, 0)",
        "stash_blk0_sb0 = stash(out_blk0_sb0, 'a0|blk0.sb0.spill.hidden')",
        "capture_part_1 = capture_part(inputs, 2, 2, 6, 0)",
        "blk0_sb1 = layer_step('prefill', 0, 1, w_blk0, h_blk0_sb1, getitem_4)",
        "collect_1 = collect(new_cache, 0, 1, 1, getitem_5, getitem_6, getitem_7)",
        "store_1 = store(new_cache, 0, 1)",
        "stash_blk0_sb1 = stash(out_blk0_sb1, 'a0|blk0.sb1.spill.hidden')",
        "load_blk0_sb0 = unstash(stash_blk0_sb0)",
        "capture_part_2 = capture_part(inputs, 4, 2, 6, 0)",
        "blk0_sb2 = layer_step('prefill', 0, 2, w_blk0, h_blk0_sb2, getitem_8)",
        "collect_2 = collect(new_cache, 0, 2, 2, getitem_9, getitem_10, getitem_11)",
        "store_2 = store(new_cache, 0, 2)",
        "stash_blk0_sb2 = stash(out_blk0_sb2, 'a0|blk0.sb2.spill.hidden')",
        "stored_blk0_sb0 = wait(stash_blk0_sb0, [out_blk0_sb0])",
        "load_blk0_sb1 = unstash(stash_blk0_sb1)",
        "h_blk1_sb0 = unstash_wait(load_blk0_sb0, getattr_1, getattr_2, getattr_3)",
        "w_blk1 = layer_weights(('w',), blk1_w)",
        "capture_part_3 = capture_part(inputs, 0, 2, 6, 1)",
        "blk1_sb0 = layer_step('prefill', 1, 0, w_blk1, h_blk1_sb0, getitem_12)",
        "cache_layout_1 = cache_layout(getitem_14, out_blk1_sb0)",
        "collect_3 = collect(new_cache, 1, 0, 0, getitem_14, getitem_15, getitem_16)",
        "store_3 = store(new_cache, 1, 0)",
        "logits_sb0 = tail_part(inputs, 0, 2, 6, getitem_13)",
        "logits = put_rows(None, logits_sb0, 0, 6)",
        "load_blk0_sb2 = unstash(stash_blk0_sb2)",
        "h_blk1_sb1 = unstash_wait(load_blk0_sb1, getattr_4, getattr_5, getattr_6)",
        "stored_blk0_sb1 = wait(stash_blk0_sb1, [out_blk0_sb1])",
        "capture_part_4 = capture_part(inputs, 2, 2, 6, 1)",
        "blk1_sb1 = layer_step('prefill', 1, 1, w_blk1, h_blk1_sb1, getitem_17)",
        "collect_4 = collect(new_cache, 1, 1, 1, getitem_19, getitem_20, getitem_21)",
        "store_4 = store(new_cache, 1, 1)",
        "logits_sb1 = tail_part(inputs, 2, 2, 6, getitem_18)",
        "logits_1 = put_rows(logits, logits_sb1, 2, 6)",
        "h_blk1_sb2 = unstash_wait(load_blk0_sb2, getattr_7, getattr_8, getattr_9)",
        "stored_blk0_sb2 = wait(stash_blk0_sb2, [out_blk0_sb2])",
        "capture_part_5 = capture_part(inputs, 4, 2, 6, 1)",
        "blk1_sb2 = layer_step('prefill', 1, 2, w_blk1, h_blk1_sb2, getitem_22)",
        "collect_5 = collect(new_cache, 1, 2, 2, getitem_24, getitem_25, getitem_26)",
        "store_5 = store(new_cache, 1, 2)",
        "logits_sb2 = tail_part(inputs, 4, 2, 6, getitem_23)",
        "logits_2 = put_rows(logits_1, logits_sb2, 4, 6)",
    ]
    # The transfers call the implementations of the `slc::` ops, not the dispatcher.
    targets = {node.target for node in graph.nodes if node.op == "call_function"}
    assert {weights.fetch_issue, weights.fetch_weight, activations.stash, activations.unstash,
            activations.unstash_wait, ops.wait} <= targets
    assert not any(isinstance(target, torch._ops.OpOverload) for target in targets)
    last = _last_uses(graph)
    # A spilled output lives until its store is waited for, a layer's weights until
    # its last step, a filled input until its step.
    assert [last[f"out_blk0_sb{sb}"] for sb in range(3)] == [f"stored_blk0_sb{sb}" for sb in range(3)]
    assert (last["w_blk0"], last["w_blk1"]) == ("blk0_sb2", "blk1_sb2")
    assert [last[f"h_blk1_sb{sb}"] for sb in range(3)] == [f"blk1_sb{sb}" for sb in range(3)]


def test_a_decode_pass_loads_caches_ahead_through_the_kv_store_and_drops_the_capture_after_its_last_step():
    request = PassRequest("decode", (0, 2), fetched=(True, False), kv_moves=True, stores=True)
    layout = PassLayout(((0, 0, 2), (2, 2, 2)), LAYOUT.tensors)
    graph = lower_pass(generation_pass(request), layout).graph
    # The KV steps in the schedule's order, each a method of the call's store or new cache.
    kv_steps = [f"{node.args[0].name}.{node.target}{tuple(node.args[1:3])}" for node in graph.nodes
                if node.op == "call_method" and node.target in ("issue", "store")]
    assert kv_steps == ["kv.issue(0, 0)", "kv.issue(0, 2)", "kv.issue(1, 0)", "new_cache.store(0, 0)",
                        "kv.issue(1, 2)", "new_cache.store(0, 2)", "new_cache.store(1, 0)",
                        "new_cache.store(1, 2)"]
    last = _last_uses(graph)
    order = [node.name for node in graph.nodes]
    assert order.index(last["calls"]) < order.index("blk1_sb2") < order.index("logits")


@pytest.mark.parametrize("dropped,message", [("spill.wait", "spill.wait blk0.sb1"),
                                             ("fill.issue", "fill.wait blk0.sb1")])
def test_a_schedule_that_leaves_a_spilled_state_unwaited_or_unloaded_is_refused(dropped, message):
    request = PassRequest("prefill", (0, 1, 2), fetched=(True, False), kv_moves=True, stores=True, rows=(2, 2),
                          spill_hidden=True)
    steps = generation_pass(request).steps
    kept = [step for step in steps if not (step.kind == dropped and (step.block, step.subbatch) == (0, 1))]
    if dropped == "fill.issue":  # its wait goes with it
        kept = [step for step in kept if not (step.kind == "fill.wait" and (step.block, step.subbatch) == (0, 1))]
    with pytest.raises(ValueError, match=message):
        lower_pass(Schedule(tuple(kept)), LAYOUT)


def test_lowering_passes_leaves_no_source_behind_in_the_process():
    # FX's GraphModule keeps every module's source for tracebacks; a process that
    # calls `generate` again and again would keep every pass it lowered.
    import linecache

    request = PassRequest("decode", (0, 2), fetched=(True, False), kv_moves=True, stores=True)
    layout = PassLayout(((0, 0, 2), (2, 2, 2)), LAYOUT.tensors)
    lower_pass(generation_pass(request), layout)
    before = len(linecache.cache)
    for _ in range(20):
        graph = lower_pass(generation_pass(request), layout)
    assert len(linecache.cache) == before
    assert "kv.issue(1, 2)" in graph.code
