"""offload_saved alone on the partitioned graphs of a two-block MLP: the saved
activations' stores and loads land where the schedule, asked again with their
lifetimes, puts them, and the step computes what eager does."""

import operator

import torch
from expecttest import assert_expected_inline

from slcompile.meta import get_slc_meta, set_slc_meta
from slcompile.passes.offload_activations import offload_saved, saved_activations
from slcompile.plans import StashPlan
from slcompile.runtime.step import StepRuntime
from slcompile.schedules.derive import schedule_of


def test_offload_saved_follows_the_schedule(partitioned, printer, mlp):
    forward, backward, state = partitioned()
    saved = saved_activations(forward, backward, 1, min_bytes=0)
    assert_expected_inline("\n".join(
        f"{a.name}: {a.owner} {a.nbytes} B, last fwd use {a.last_forward_use}, first bwd use {a.first_backward_use}"
        + (f", stays: {a.stays}" if a.stays else "") for a in saved), """\
slice_1: ('prefix', None, 0) 64 B, last fwd use ('prefix', None, 0), first bwd use ('prefix', None, 0), stays: a graph input or a view of one
addmm: ('prefix', None, 0) 64 B, last fwd use ('block', 0, 0), first bwd use ('block', 0, 0)
slice_2: ('prefix', None, 1) 64 B, last fwd use ('prefix', None, 1), first bwd use ('prefix', None, 1), stays: a graph input or a view of one
addmm_1: ('prefix', None, 1) 64 B, last fwd use ('block', 0, 1), first bwd use ('block', 0, 1)
t_2: ('block', 0, 0) 256 B, last fwd use ('block', 0, 0), first bwd use ('block', 0, 0), stays: a graph input or a view of one
relu: ('block', 0, 0) 64 B, last fwd use ('block', 1, 0), first bwd use ('block', 1, 0)
detach: ('block', 0, 0) 64 B, last fwd use ('block', 0, 0), first bwd use ('block', 0, 1)
t_3: ('block', 0, 1) 256 B, last fwd use ('block', 0, 1), first bwd use ('block', 0, 1), stays: a graph input or a view of one
relu_1: ('block', 0, 1) 64 B, last fwd use ('block', 1, 1), first bwd use ('block', 1, 1)
detach_1: ('block', 0, 1) 64 B, last fwd use ('block', 0, 1), first bwd use ('block', 1, 0)
t_4: ('block', 1, 0) 256 B, last fwd use ('block', 1, 0), first bwd use ('block', 1, 0), stays: a graph input or a view of one
relu_2: ('block', 1, 0) 64 B, last fwd use ('suffix', None, 0), first bwd use ('suffix', None, 0)
detach_2: ('block', 1, 0) 64 B, last fwd use ('block', 1, 0), first bwd use ('block', 1, 1)
t_5: ('block', 1, 1) 256 B, last fwd use ('block', 1, 1), first bwd use ('block', 1, 1), stays: a graph input or a view of one
relu_3: ('block', 1, 1) 64 B, last fwd use ('suffix', None, 1), first bwd use ('suffix', None, 1)
detach_3: ('block', 1, 1) 64 B, last fwd use ('block', 1, 1), first bwd use ('suffix', None, 0)
t_6: None 32 B, last fwd use ('suffix', None, 0), first bwd use ('suffix', None, 1), stays: a graph input or a view of one
t_7: None 32 B, last fwd use ('suffix', None, 1), first bwd use None, stays: a graph input or a view of one""")
    schedule = state.schedule.replan(saved=saved, activations_offloaded=True)
    stash = StashPlan("golden", "nvme")
    before = printer.lines(forward), printer.lines(backward)
    offloaded = offload_saved(forward, backward, 1, stash.graph_key, saved, schedule)
    assert offloaded.names
    assert_expected_inline(printer.diff(before[0], printer.lines(forward)), """\
+stash_default = stash.default(addmm, 'golden|prefix.sb0.addmm')  # prefix.sb0
+stash_default_1 = stash.default(addmm_1, 'golden|prefix.sb1.addmm_1')  # prefix.sb1
+stash_default_2 = stash.default(relu, 'golden|blk0.sb0.relu')  # blk0.sb0
+stash_default_3 = stash.default(detach, 'golden|blk0.sb0.detach')  # blk0.sb0
+wait_default = wait.default(stash_default, [addmm])  # prefix.sb0
+wait_default_1 = wait.default(stash_default_3, [detach])  # blk0.sb0
+stash_default_4 = stash.default(relu_1, 'golden|blk0.sb1.relu_1')  # blk0.sb1
+stash_default_5 = stash.default(detach_1, 'golden|blk0.sb1.detach_1')  # blk0.sb1
+wait_default_2 = wait.default(stash_default_1, [addmm_1])  # prefix.sb1
+wait_default_3 = wait.default(stash_default_5, [detach_1])  # blk0.sb1
+stash_default_6 = stash.default(relu_2, 'golden|blk1.sb0.relu_2')  # blk1.sb0
+stash_default_7 = stash.default(detach_2, 'golden|blk1.sb0.detach_2')  # blk1.sb0
+wait_default_4 = wait.default(stash_default_2, [relu])  # blk0.sb0
+wait_default_5 = wait.default(stash_default_7, [detach_2])  # blk1.sb0
+stash_default_8 = stash.default(relu_3, 'golden|blk1.sb1.relu_3')  # blk1.sb1
+stash_default_9 = stash.default(detach_3, 'golden|blk1.sb1.detach_3')  # blk1.sb1
+wait_default_6 = wait.default(stash_default_4, [relu_1])  # blk0.sb1
+wait_default_7 = wait.default(stash_default_9, [detach_3])  # blk1.sb1
+wait_default_8 = wait.default(stash_default_6, [relu_2])  # blk1.sb0
-return [add, slice_1, addmm, slice_2, addmm_1, t_2, relu, detach, t_3, relu_1, detach_1, t_4, relu_2, detach_2, t_5, relu_3, detach_3, t_6, t_7]
+wait_default_9 = wait.default(stash_default_8, [relu_3])  # blk1.sb1
+return [add, slice_1, stash_default, slice_2, stash_default_1, t_2, stash_default_2, stash_default_3, t_3, stash_default_4, stash_default_5, t_4, stash_default_6, stash_default_7, t_5, stash_default_8, stash_default_9, t_6, t_7]""")
    assert_expected_inline(printer.diff(before[1], printer.lines(backward)), """\
+unstash_default = unstash.default(stash_default_6)  # blk1.sb0
+unstash_default_1 = unstash.default(stash_default_8)  # blk1.sb1
+unstash_default_2 = unstash.default(stash_default_9)  # blk1.sb1
+unstash_wait_default = unstash_wait.default(unstash_default_1, [2, 8], torch.float32, device(type='cpu'))  # blk1.sb1
-mm_1 = mm.default(t_9, relu_3)  # suffix.sb1
+mm_1 = mm.default(t_9, unstash_wait_default)  # suffix.sb1
+unstash_default_3 = unstash.default(stash_default_4)  # blk0.sb1
+unstash_default_4 = unstash.default(stash_default_7)  # blk1.sb0
+unstash_wait_default_1 = unstash_wait.default(unstash_default, [2, 8], torch.float32, device(type='cpu'))  # blk1.sb0
+unstash_wait_default_2 = unstash_wait.default(unstash_default_2, [2, 8], torch.float32, device(type='cpu'))  # blk1.sb1
-mm_3 = mm.default(t_13, relu_2)  # suffix.sb0
+mm_3 = mm.default(t_13, unstash_wait_default_1)  # suffix.sb0
-detach_4 = detach.default(detach_3)  # blk1.sb1
+detach_4 = detach.default(unstash_wait_default_2)  # blk1.sb1
+unstash_default_5 = unstash.default(stash_default_2)  # blk1.sb1
+unstash_default_6 = unstash.default(stash_default_5)  # blk1.sb1
+unstash_wait_default_3 = unstash_wait.default(unstash_default_3, [2, 8], torch.float32, device(type='cpu'))  # blk1.sb1
+unstash_wait_default_4 = unstash_wait.default(unstash_default_4, [2, 8], torch.float32, device(type='cpu'))  # blk1.sb1
-mm_5 = mm.default(t_17, relu_1)  # blk1.sb1
+mm_5 = mm.default(t_17, unstash_wait_default_3)  # blk1.sb1
-detach_5 = detach.default(detach_2)  # blk1.sb0
+detach_5 = detach.default(unstash_wait_default_4)  # blk1.sb0
+unstash_default_7 = unstash.default(stash_default_1)  # blk1.sb0
+unstash_default_8 = unstash.default(stash_default_3)  # blk1.sb0
+unstash_wait_default_5 = unstash_wait.default(unstash_default_5, [2, 8], torch.float32, device(type='cpu'))  # blk1.sb0
+unstash_wait_default_6 = unstash_wait.default(unstash_default_6, [2, 8], torch.float32, device(type='cpu'))  # blk1.sb0
-mm_7 = mm.default(t_21, relu)  # blk1.sb0
+mm_7 = mm.default(t_21, unstash_wait_default_5)  # blk1.sb0
-detach_6 = detach.default(detach_1)  # blk0.sb1
+detach_6 = detach.default(unstash_wait_default_6)  # blk0.sb1
+unstash_default_9 = unstash.default(stash_default)  # blk0.sb1
+unstash_wait_default_7 = unstash_wait.default(unstash_default_7, [2, 8], torch.float32, device(type='cpu'))  # blk0.sb1
+unstash_wait_default_8 = unstash_wait.default(unstash_default_8, [2, 8], torch.float32, device(type='cpu'))  # blk0.sb1
-mm_9 = mm.default(t_25, addmm_1)  # blk0.sb1
+mm_9 = mm.default(t_25, unstash_wait_default_7)  # blk0.sb1
-detach_7 = detach.default(detach)  # blk0.sb0
+detach_7 = detach.default(unstash_wait_default_8)  # blk0.sb0
+unstash_wait_default_9 = unstash_wait.default(unstash_default_9, [2, 8], torch.float32, device(type='cpu'))  # blk0.sb0
-mm_11 = mm.default(t_29, addmm)  # blk0.sb0
+mm_11 = mm.default(t_29, unstash_wait_default_9)  # blk0.sb0""")
    assert schedule_of(forward, backward).text() == schedule.text()

    # The stash the plan names, as a compiled step makes it when it starts.
    runtime = StepRuntime(None, stash, None)
    runtime.start(blocks=())
    outputs = torch.fx.Interpreter(forward).run(*state.example_inputs)
    loss, saved_values = outputs[0], outputs[1:]
    grads = torch.fx.Interpreter(backward).run(*saved_values, torch.ones_like(loss))
    model, x = mlp
    torch.testing.assert_close(loss, model(x))
    eager = torch.autograd.grad(model(x), [p for p in state.example_inputs if p.requires_grad])
    torch.testing.assert_close([g for g in grads if g is not None], list(eager))


def test_attentions_random_state_stays(partitioned):
    # CUDA attention's random seed and offset are traced on the device, but are CPU
    # tensors when the op runs (CUDA ones under graph capture): neither the bytes nor
    # the destination of their move would be what the plan says.
    forward, backward, _ = partitioned()
    relu = next(node for node in forward.graph.nodes if node.name == "relu")
    value = relu.meta["val"]
    with forward.graph.inserting_after(relu):
        query = forward.graph.call_function(torch.ops.aten.unsqueeze.default, (relu, 0))
        query.meta["val"] = value.unsqueeze(0)
    with forward.graph.inserting_after(query):
        attention = forward.graph.call_function(
            torch.ops.aten._scaled_dot_product_efficient_attention.default, (query, query, query, None, True))
    for index, name in enumerate(["output", "log_sumexp", "philox_seed", "philox_offset"]):
        with forward.graph.inserting_after(attention):
            result = forward.graph.call_function(operator.getitem, (attention, index), name=name)
        result.meta["val"] = torch.empty((), dtype=torch.int64) if "philox" in name else value
        set_slc_meta(result, get_slc_meta(relu))
    output = next(node for node in forward.graph.nodes if node.op == "output")
    output.args = ([*output.args[0], *(n for n in forward.graph.nodes if n.name.startswith(("philox", "log_")))],)
    stays = {a.name: a.stays for a in saved_activations(forward, backward, 1, min_bytes=0)}
    assert stays["philox_seed"] == stays["philox_offset"] == "attention's random state, whose device is chosen when it runs"
    assert stays["log_sumexp"] != stays["philox_seed"] and stays["relu_1"] is None


def test_flash_attentions_random_state_is_recognised_by_its_results_names():
    # torch 2.13 names them rng_state and unused, earlier releases philox_seed and philox_offset.
    from slcompile.passes.offload_activations import _random_state

    graph = torch.fx.Graph()
    query = graph.placeholder("query")
    flash = graph.call_function(torch.ops.aten._scaled_dot_product_flash_attention.default, (query, query, query))
    results = [graph.call_function(operator.getitem, (flash, i)) for i in range(9)]
    assert [_random_state(node) for node in results] == [False] * 6 + [True, True, False]
    assert not _random_state(graph.call_function(operator.getitem, (query, 0)))
