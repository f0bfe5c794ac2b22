"""An example policy: speedloader's order, keeping on the device the saved tensors
that chosen modules make, by module path, and stashing the others.

Once the forward and backward are partitioned, each saved tensor of the request
(`request.saved`, `SavedActivation`) names the module whose forward made it
(`module_path`: `model.layers.3.self_attn`, `model.layers.3.mlp.act_fn`) and the op
(`op`: `aten.mm.default`). Node names (`mul_4`, `view_8`) differ between models and
between torch releases; module paths are the model's own names, so a policy that
picks by them means the same tensors on every model of a family. This one keeps the
tensors whose module path has a component `keep` names (by default `self_attn`: the
attention's outputs, its projections' included) in `Schedule.kept_saved`, and
`add_stashes` places the transfers of the others:

    from slcompile.schedules.examples.keep_by_module import keep_by_module_policy

    keep_attention = keep_by_module_policy("self_attn")
    options = {"schedule": keep_attention, "activations": "nvme"}

`KEEP_ATTENTION` is that policy, named "keep_attention". Before the saved tensors are
known (the Dynamo stage) nothing is kept: the policy writes speedloader's schedule.
"""

from __future__ import annotations

from slcompile.schedules.base import SavedActivation, Schedule, ScheduleRequest, add_fetches
from slcompile.schedules.policy import Policy
from slcompile.schedules.speedloader import add_stashes, add_stores, layer_major_compute

__all__ = ["keep_by_module_policy", "kept_by_module", "KEEP_ATTENTION"]


def kept_by_module(saved, *modules: str) -> frozenset[str]:
    """The names of the saved tensors that may leave the device (`stays` None) and
    whose module path has one of `modules` as a component (`self_attn` matches
    `model.layers.3.self_attn` and `model.layers.3.self_attn.o_proj`, not
    `model.layers.3.self_attn_norm`)."""
    wanted = set(modules)

    def chosen(activation: SavedActivation) -> bool:
        path = activation.module_path
        return activation.stays is None and path is not None and bool(wanted & set(path.split(".")))

    return frozenset(activation.name for activation in saved or () if chosen(activation))


def keep_by_module_policy(*modules: str, name: str | None = None) -> Policy:
    """The policy that keeps the saved tensors of the modules named (path
    components: "self_attn", "mlp") on the device, in speedloader's order.

    Args:
        modules: path components of the modules whose saved tensors stay; at least one.
        name: the policy's name (default: "keep_" and the modules, joined by "_").
    """
    if not modules or not all(isinstance(m, str) and m and "." not in m for m in modules):
        raise ValueError(f"keep_by_module_policy takes module path components ('self_attn', 'mlp'), got {modules!r}")

    def build(request: ScheduleRequest) -> Schedule:
        kept = kept_by_module(request.saved, *modules)
        steps = add_fetches(layer_major_compute(request), request, per_subbatch=False)
        steps = add_stashes(steps, request, kept_saved=kept)
        return Schedule(tuple(add_stores(steps, request)), kept_saved=kept)

    return Policy(name or "keep_" + "_".join(modules), build, suffix="whole")


KEEP_ATTENTION = keep_by_module_policy("self_attn", name="keep_attention")
