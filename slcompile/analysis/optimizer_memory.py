"""The optimizer step's memory in a training step, per tier (`optimizer_memory`):
the state and temporaries of the resident parameters' step on the device, and the
host's and nvme's shares of the streamed weights' (master weights, states, the
gradients a block step reads). The training step's model
(`slcompile.analysis.memory.predict_memory`) adds the device's share to its peak;
`explain` and the offloaded optimizer (`slcompile.optim`) report the rest.

With the streamed weights sharded over W ranks (`shard_weights`,
`MachineFacts.world_size`) the host's copies, states and gradients of streamed
weights are one rank's shards, `ceil(numel / W)` elements each (the padding
included).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from slcompile.analysis.machine import MachineFacts

__all__ = [
    "OptimizerMemory",
    "optimizer_memory",
]


@dataclasses.dataclass(frozen=True)
class OptimizerMemory:
    """The optimizer step's share of a training step's memory, in bytes, per tier
    (`optimizer_memory`).

    Attributes:
        name: the optimizer class's name.
        states_tier: where the streamed weights' optimizer state rests ("host", "nvme").
        device_state_bytes: the optimizer state of the parameters stepped on the
            device (those not streamed), held from one step to the next.
        device_step_bytes: the most bytes the temporaries of the device's step take
            at once (torch's for-loop, foreach or fused implementation).
        host_master_bytes: the host copies of the weights the host steps (fp32 for
            bf16/fp16 parameters).
        host_state_bytes: the optimizer state that rests in host memory.
        host_gradient_bytes: gradients in host memory waiting for their block's step
            (one block's; with `max_grad_norm` every streamed weight's, until `step()`).
        host_step_bytes: the temporaries of one block's step on the host, and with
            nvme states the block's state loaded for it.
        nvme_state_bytes: the optimizer state that rests in nvme files.
        host_is_device: host memory is the device's memory (a CPU-only machine).
    """

    name: str
    states_tier: str
    device_state_bytes: int
    device_step_bytes: int
    host_master_bytes: int = 0
    host_state_bytes: int = 0
    host_gradient_bytes: int = 0
    host_step_bytes: int = 0
    nvme_state_bytes: int = 0
    host_is_device: bool = False

    @property
    def host_bytes(self) -> int:
        """The host's share at its most."""
        return self.host_master_bytes + self.host_state_bytes + self.host_gradient_bytes + self.host_step_bytes


_LOW_PRECISION = (torch.bfloat16, torch.float16)
# Scalar temporaries of a step (bias corrections, a step count's copy); a few bytes.
_STEP_SCALAR_BYTES = 64


def optimizer_memory(
    optimizer_class: type[torch.optim.Optimizer],
    options: Mapping[str, Any],
    resident: Sequence[Sequence[torch.Tensor]],
    streamed: Sequence[Sequence[torch.Tensor]] = (),
    *,
    states: str = "host",
    max_grad_norm: float | None = None,
    machine: MachineFacts = MachineFacts(),
) -> OptimizerMemory:
    """The memory an optimizer step of `optimizer_class` takes, per tier, as
    `slcompile.offload_optimizer` runs it: the resident parameters stepped on the
    device by one instance, each block of streamed parameters on the host by its own.

    The state per parameter is what one step of `optimizer_class` with `options`
    leaves (found by stepping a 3-element tensor once). The temporaries follow what
    torch's implementations allocate on the CPU (measured with `measured_peak_bytes`,
    tests/test_optimizer_memory.py): the for-loop one per parameter in turn (Adam(W)
    two tensors of its size, three with maximize or L2 weight decay, while
    the previous parameter's denominator lives; SGD one with weight decay or
    maximize, one more with nesterov), the foreach one a list the size of the whole
    group (SGD none without weight decay or maximize), the fused one none. Other
    classes are given the most any other of torch's optimizers takes (Adadelta,
    NAdam): three tensors of the parameter's size and the previous one's (for-loop),
    three times the group (foreach).

    Args:
        optimizer_class: the optimizer class.
        options: its options (lr, weight_decay, foreach, ...).
        resident: the parameters stepped on the device, per param group, in order;
            bf16/fp16 ones are stepped on fp32 host copies instead.
        streamed: the streamed parameters, per block (the host steps them).
        states: where the streamed weights' state rests: "host" or "nvme".
        max_grad_norm: the clip of `offload_optimizer`: every streamed gradient then
            waits in host memory for `step()`.
        machine: the machine's facts: whether host memory is the device's (a
            CPU-only machine), and the ranks the streamed weights are sharded over
            (`world_size`; `shard_weights`): the host steps this rank's shard of each.
    """
    weight_shards = machine.world_size
    per_element, scalar_bytes = _state_layout(optimizer_class, options)

    def state_bytes(nbytes: int) -> int:
        return int(per_element * nbytes) + scalar_bytes

    device_groups = [[_nbytes(p) for p in group if p.dtype not in _LOW_PRECISION] for group in resident]
    on_host = [p for group in resident for p in group if p.dtype in _LOW_PRECISION]
    blocks = [[_master_bytes(p, weight_shards) for p in block] for block in streamed]
    if on_host:
        blocks.append([_master_bytes(p) for p in on_host])
    foreach = options.get("foreach")
    if foreach is None:  # torch's default: foreach kernels where the device has them
        foreach = any(p.device.type in ("cuda", "xpu") for group in resident for p in group)
    device_step = _temporaries(optimizer_class, options, device_groups, bool(foreach))
    host_step = max((_temporaries(optimizer_class, options, [block], bool(options.get("foreach")))
                     for block in blocks), default=0)
    masters = sum(sum(block) for block in blocks)
    host_states = sum(state_bytes(b) for block in blocks for b in block)
    scalars = scalar_bytes * sum(len(block) for block in blocks)
    nvme = 0
    if states == "nvme":
        # Tensor states rest in files (scalars stay); one block's are loaded for its step.
        nvme = host_states - scalars
        host_step += max((sum(state_bytes(b) - scalar_bytes for b in block) for block in blocks), default=0)
        host_states = scalars
    gradients = masters if max_grad_norm is not None else max((sum(block) for block in blocks), default=0)
    return OptimizerMemory(
        name=optimizer_class.__name__,
        states_tier=states,
        device_state_bytes=sum(state_bytes(b) for group in device_groups for b in group),
        device_step_bytes=device_step,
        host_master_bytes=masters,
        host_state_bytes=host_states,
        host_gradient_bytes=gradients if blocks else 0,
        host_step_bytes=host_step,
        nvme_state_bytes=nvme,
        host_is_device=machine.host_is_device,
    )


def _nbytes(tensor: torch.Tensor) -> int:
    return int(tensor.numel()) * tensor.element_size()


def _master_bytes(param: torch.Tensor, shards: int = 1) -> int:
    """Bytes of a parameter's host copy: this rank's zero-padded shard of it over `shards` ranks."""
    return -(-int(param.numel()) // shards) * (4 if param.dtype in _LOW_PRECISION else param.element_size())


@functools.lru_cache(maxsize=64)
def _state_layout_cached(optimizer_class, options: tuple) -> tuple[float, int]:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        param = torch.zeros(3, requires_grad=True)
        param.grad = torch.ones(3)
        optimizer = optimizer_class([param], **dict(options))
        optimizer.step()
        state = optimizer.state[param]
    per_element, scalars = 0.0, 0
    for value in state.values():
        if not isinstance(value, torch.Tensor):
            continue
        if value.dim() == 0:
            scalars += value.element_size()
        else:
            per_element += value.numel() * value.element_size() / _nbytes(param)
    return per_element, scalars


def _state_layout(optimizer_class, options: Mapping[str, Any]) -> tuple[float, int]:
    """(state bytes per parameter byte, bytes of scalar state per parameter) after a step."""
    accepted = inspect.signature(optimizer_class.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        # A group's options may hold more than the constructor takes (AdamW's decoupled_weight_decay).
        options = {key: value for key, value in options.items() if key in accepted}
    try:
        key = tuple(sorted(options.items()))
        hash(key)
    except TypeError:  # unhashable options (a tensor lr): not cached
        return _state_layout_cached.__wrapped__(optimizer_class, tuple(options.items()))
    return _state_layout_cached(optimizer_class, key)


def _temporaries(optimizer_class, options: Mapping[str, Any], groups: Sequence[Sequence[int]], foreach: bool) -> int:
    """The most bytes a step's temporaries take at once, over the param groups
    (parameter bytes, in order); see `optimizer_memory`."""
    if options.get("fused"):
        return 0
    per_param, previous, per_group = 3, 1, 3
    weight_decay = options.get("weight_decay", 0) != 0
    if issubclass(optimizer_class, torch.optim.Adam):
        decoupled = issubclass(optimizer_class, torch.optim.AdamW) or options.get("decoupled_weight_decay")
        extra = options.get("maximize") or (weight_decay and not decoupled)
        per_param, previous, per_group = (3 if extra else 2), 1, 1
    elif issubclass(optimizer_class, torch.optim.SGD):
        extra = int(bool(weight_decay or options.get("maximize")))
        per_param, previous, per_group = extra + int(bool(options.get("nesterov"))), 0, extra
    most = 0
    for group in groups:
        if not group:
            continue
        if foreach:
            most = max(most, per_group * sum(group))
        else:
            most = max(most, max(per_param * b + previous * a for a, b in zip([0, *group], group)))
    return most + (_STEP_SCALAR_BYTES if any(groups) else 0)
