"""One block's step on the host: an instance of the user's optimizer class over host
copies of the block's parameters, with its state in host memory or in nvme files
between steps; a step can be kept beside the previous one until it is committed or
rolled back (`slcompile.optim`'s docstring says when). `OffloadedOptimizer` makes
one per block and runs it on its worker thread."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from slcompile.runtime.storage.engine import TransferEngine
from slcompile.runtime.errors import OffloadError
from slcompile.runtime.storage.tiers import Tier, TransferKind
from slcompile.runtime.weights import weight_home

__all__: list[str] = []


class _HostStep:
    """One optimizer instance over host copies of one block's parameters, with its
    state on the host or in nvme files between steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                 masters: list[torch.Tensor], tier: Tier, engine: TransferEngine, prefix: str,
                 group_ids: list[int], param_groups: list[dict[str, Any]], names: list[str]):
        self.optimizer = optimizer
        self.names = names  # each parameter's name in the model: the state files' keys name it
        self.group_ids = group_ids  # the user-facing group of each of `optimizer`'s groups
        self.param_groups = param_groups
        self.params = params
        self.masters = masters
        self.tier = tier
        self.engine = engine
        self.prefix = prefix
        self.stored: dict[int, dict[str, str]] = {}  # master index -> state name -> its nvme key
        self.generation = 0
        # With keep_previous, until `commit` or `roll_back`: what the block was before
        # the step. Masters: a host copy, or None where the weight's tier holds the
        # same values (a master of the weight's own dtype). State: host copies of what
        # no nvme file of `stored` keeps; and those files, kept until then.
        self.previous: tuple[list[torch.Tensor | None], list[dict[str, Any]], dict[int, dict[str, str]]] | None = None

    def step(self, keep_previous: bool = False) -> OffloadError | None:
        """Steps the block.

        Args:
            keep_previous: keep what the block was before the step until `commit` or
                `roll_back`, and store the new state beside the previous files; a
                failure to store it is then raised after going back to before the step.
                Without: a failure to store the state after the step is returned (not
                raised), so the caller still writes the updated weights before raising it.
        """
        if self.tier is Tier.NVME:
            self._load_states()
        if keep_previous:
            self.previous = (
                [None if master.dtype == param.dtype else master.detach().clone()
                 for param, master in zip(self.params, self.masters)],
                [{k: _copy(v) for k, v in self.optimizer.state.get(master, {}).items()
                  if k not in self.stored.get(index, {})} for index, master in enumerate(self.masters)],
                self.stored,
            )
        _take_options(self.optimizer, self.group_ids, self.param_groups)
        self.optimizer.step()
        for master in self.masters:
            master.grad = None
        if self.tier is Tier.NVME:
            try:
                self._store_states()
            except OffloadError as error:
                if keep_previous:
                    self.roll_back()
                    raise
                return error
        return None

    def commit(self) -> None:
        """The step kept by `step(keep_previous=True)` stays: the previous files go."""
        _, _, stored = self.previous
        self.previous = None
        if stored is not self.stored:
            self._free(stored)

    def _store_states(self) -> None:
        """Stores every state tensor under a fresh key; only once all are written are
        the host copies dropped, and the previous files (at `commit`, when the step
        keeps what it was before). A failed store (a full disk) leaves no file of this
        step behind, and the state whole in host memory."""
        self.generation += 1
        issued: dict[int, dict[str, str]] = {}
        handles = []
        try:
            for index, master in enumerate(self.masters):
                state = self.optimizer.state.get(master, {})
                for name, value in state.items():
                    # Scalars (Adam's step count) stay: not worth a file each.
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        key = f"{self.prefix}:{self.names[index]}:{name}#{self.generation}"
                        issued.setdefault(index, {})[name] = key
                        handles.append(self.engine.store(key, value, Tier.NVME, TransferKind.OPTIMIZER_STATE))
            for handle in handles:
                self.engine.wait(handle)
        except OffloadError:
            self._free(issued)
            if self.previous is None:
                self._free(self.stored)  # older than the state in host memory now
                self.stored = {}
            raise
        if self.previous is None:
            self._free(self.stored)
        self.stored = issued
        for index, keys in issued.items():
            state = self.optimizer.state[self.masters[index]]
            for name in keys:
                del state[name]

    def roll_back(self) -> None:
        """Puts back what `step(keep_previous=True)` kept: the masters (copied back, or
        loaded from the weights' tier, which still holds the previous values), the
        state in host memory and the previous state files."""
        masters, states, stored = self.previous
        self.previous = None
        loads = [(master, weight_home(param)[0], weight_home(param)[0].load(weight_home(param)[1], TransferKind.WEIGHT))
                 for param, master, values in zip(self.params, self.masters, masters) if values is None]
        with torch.no_grad():
            for master, values in zip(self.masters, masters):
                if values is not None:
                    master.copy_(values)
            for master, engine, load in loads:
                master.copy_(engine.wait(load).view(master.shape))
        if stored is not self.stored:
            self._free(self.stored)  # the state stored after the step
        self.stored = stored
        for master, values in zip(self.masters, states):
            if values:
                self.optimizer.state[master] = values
            else:
                self.optimizer.state.pop(master, None)

    def _load_states(self) -> None:
        loads = [(index, name, self.engine.load(key, TransferKind.OPTIMIZER_STATE))
                 for index, keys in self.stored.items() for name, key in keys.items()]
        for index, name, handle in loads:
            self.optimizer.state[self.masters[index]][name] = self.engine.wait(handle)

    def state_of(self, index: int) -> dict[str, Any]:
        """A host copy of one parameter's state, loaded from nvme where it rests there."""
        values = {k: _copy(v) for k, v in self.optimizer.state.get(self.masters[index], {}).items()}
        for name, key in self.stored.get(index, {}).items():
            values[name] = self.engine.wait(self.engine.load(key, TransferKind.OPTIMIZER_STATE))
        return values

    def set_state(self, index: int, values: Mapping[str, Any]) -> None:
        """Replaces one parameter's state (nvme copies are dropped; the next step stores it again)."""
        self._free({index: self.stored.pop(index, {})})
        self.optimizer.state[self.masters[index]] = {k: _copy(v) for k, v in values.items()}

    def free(self) -> None:
        self._free(self.stored)
        self.stored = {}

    def _free(self, stored: Mapping[int, Mapping[str, str]]) -> None:
        for keys in stored.values():
            for key in keys.values():
                if key in self.engine:
                    self.engine.free(key)


def _options(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's options: everything but its parameters."""
    return {key: value for key, value in group.items() if key != "params"}


def _take_options(optimizer: torch.optim.Optimizer, group_ids: list[int], param_groups: list[dict[str, Any]]) -> None:
    """Sets the options of `optimizer`'s groups from the user-facing groups they
    stand for (a scheduler may have changed the learning rate since the last step)."""
    for group, index in zip(optimizer.param_groups, group_ids):
        group.update(_options(param_groups[index]))


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value
