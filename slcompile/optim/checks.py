"""What the offloaded optimizer (`slcompile.optim.optimizer`) refuses, and why: an
optimizer class whose step needs every gradient at once, a loaded state of another
shard size, and a step whose closure would clip gradients it cannot see."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from slcompile.runtime.weights import shard_group_of

__all__ = ["check_optimizer_class", "check_state_size", "refuse_lightning_clip"]


def check_state_size(param: torch.nn.Parameter, name: str, values: Mapping[str, Any], master: torch.Tensor) -> None:
    """Refuses a loaded state of a sharded weight whose tensors are not the size of
    the host copy, this rank's shard, they step with (an elementwise optimizer's
    state always is; others keep their own shapes and checks)."""
    if shard_group_of(param) is None:
        return
    for key, value in values.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() != master.numel():
            raise ValueError(
                f"load_state_dict: the optimizer state {key!r} of {name!r} has {value.numel()} elements, its "
                f"host copy {master.numel()}: a state of a weight sharded over another number of ranks (or "
                "not sharded); load it with slcompile.load_sharded into a model compiled with the same "
                "shard_weights"
            )


def refuse_lightning_clip(closure: Callable) -> None:
    """Refuses a step whose closure clips gradients for Lightning's Trainer.

    Lightning's automatic optimization hands `step` `partial(precision._wrap_closure,
    module, optimizer, closure)`, which runs the backward and then, with
    `Trainer(gradient_clip_val=...)`, `torch.nn.utils.clip_grad_norm_` (or
    `clip_grad_value_`) over the `.grad` of `param_groups`: the streamed weights'
    gradients never become `.grad`, and their blocks may have stepped already, so the
    clip would scale the resident parameters by their own norm alone. Found before
    the closure runs, nothing has changed when this raises.
    """
    for candidate in getattr(closure, "args", ()):
        try:
            trainer = getattr(candidate, "trainer", None)
        except RuntimeError:  # a LightningModule not attached to a Trainer
            continue
        clip = getattr(trainer, "gradient_clip_val", None)
        if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0:
            algorithm = getattr(trainer, "gradient_clip_algorithm", None)
            how = f"gradient_clip_algorithm={getattr(algorithm, 'value', algorithm)!r}" if algorithm else "by norm"
            raise ValueError(
                f"Trainer(gradient_clip_val={clip!r}) clips {how} the .grad of the optimizer's parameters, but the "
                "streamed weights' gradients go to the offloaded optimizer and never become .grad: it would clip "
                "the resident parameters alone. Leave gradient_clip_val unset and clip by the whole model's norm "
                f"with slcompile.offload_optimizer(..., max_grad_norm={clip!r})"
            )


def check_optimizer_class(optimizer_class) -> None:
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"offload_optimizer needs a torch.optim.Optimizer subclass, got {optimizer_class!r}")
    if issubclass(optimizer_class, torch.optim.LBFGS):
        raise ValueError(
            "offload_optimizer cannot run LBFGS: its step needs every gradient at once and re-evaluates "
            "the loss with a closure, but the offloaded optimizer steps each block as its gradients "
            "arrive; keep LBFGS on the device (weights='device', gradients='device')"
        )
    if issubclass(optimizer_class, torch.optim.SparseAdam):
        raise ValueError("offload_optimizer cannot run SparseAdam: block weights get dense gradients")
