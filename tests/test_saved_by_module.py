"""Saved tensors a policy can pick by meaning: each `SavedActivation` names the op
that made it and its module path, and the example policy that keeps attention's
saved tensors on the device by module path keeps exactly those."""

import pytest
import torch

import slcompile
from conftest import assert_matches_eager
from models import hf_llama
from slcompile.schedules import Policy
from slcompile.schedules.examples.keep_by_module import KEEP_ATTENTION, keep_by_module_policy, kept_by_module

OPTIONS = {"lowering": "aot_eager", "num_subbatches": 2, "activations": "nvme", "min_offload_bytes": 0}


def _recording(policy):
    """`policy`, and the saved tensors of the last request it was asked with them."""
    seen = []

    def build(request):
        if request.saved is not None:
            seen[:] = [request.saved]
        return policy.build(request)

    return Policy(policy.name, build, suffix=policy.suffix), seen


def _llama():
    torch.manual_seed(0)
    return hf_llama(num_hidden_layers=2), torch.randint(0, 96, (4, 16))


def _in(module, activation):
    return activation.module_path is not None and module in activation.module_path.split(".")


def test_saved_tensors_name_their_op_and_module_and_the_example_keeps_attention_by_path():
    model, ids = _llama()
    policy, seen = _recording(KEEP_ATTENTION)
    explanation = slcompile.explain(model, ids, kwargs={"labels": ids}, profile=None, schedule=policy, **OPTIONS)
    graph = explanation.graphs[0]
    assert graph.fallback_reason is None
    saved = seen[0]
    by_name = {a.name: a for a in saved}
    # Every tensor a block makes is of that block's module, in the model's own names.
    for activation in saved:
        if activation.owner is not None and activation.owner[0] == "block":
            assert activation.module_path.startswith(f"model.layers.{activation.owner[1]}"), activation
        if activation.owner is not None and activation.owner[0] == "prefix" and activation.stays is None:
            assert activation.module_path == "model.embed_tokens" and activation.op == "aten.embedding.default"
    attention = [a for a in saved if a.op is not None and a.op.startswith("aten._scaled_dot_product")]
    assert attention and all(a.module_path.endswith(".self_attn") for a in attention)
    silu = [a for a in saved if a.op == "aten.silu.default"]
    assert len(silu) == 4 and {a.module_path for a in silu} == {"model.layers.0.mlp.act_fn",
                                                                 "model.layers.1.mlp.act_fn"}
    assert any(_in("self_attn", a) for a in saved) and any(_in("mlp", a) for a in saved)
    assert all(a.op is None for a in saved if a.name.startswith("primals"))
    # The example keeps exactly the attention's tensors that may leave, by path;
    # every unit still stashes the rest.
    kept = {a.name for a in saved if a.stays is None and _in("self_attn", a)}
    assert kept and graph.planned_schedule.kept_saved == kept
    assert all(by_name[name].op is not None for name in kept)
    assert {a.name for a in saved if a.stays is None and _in("mlp", a)}.isdisjoint(kept)
    assert sum("stash" in line for line in graph.activation_plan) == 6  # 2 prefix units, 4 block units
    # Picked by another module, the same rule.
    assert kept_by_module(saved, "mlp") == {a.name for a in saved if a.stays is None and _in("mlp", a)}


def test_the_example_policy_trains_as_eager():
    model, ids = _llama()
    policy, seen = _recording(KEEP_ATTENTION)
    assert_matches_eager(model, lambda m: _outputs(m, ids), {**OPTIONS, "schedule": policy})
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    assert report.planned_schedule.kept_saved == {a.name for a in seen[0] if a.stays is None
                                                  and _in("self_attn", a)}


def _outputs(model, ids):
    out = model(ids, labels=ids)
    return out.logits, out.loss


def test_module_names_are_path_components():
    with pytest.raises(ValueError, match="module path components"):
        keep_by_module_policy("layers.0.self_attn")
    assert keep_by_module_policy("self_attn", "mlp").name == "keep_self_attn_mlp"
