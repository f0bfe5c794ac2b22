"""The host copies an offloaded optimizer steps: one per parameter it updates on the
host (fp32 for a bf16/fp16 parameter, this rank's flat shard for a sharded one), made
from the parameter's values or its stored weight the first time they are asked for,
and written back to the weight's tier after a step. Offloaded parameters hold no
memory, so the model's `state_dict()` and `load_state_dict()` read and write them
through these copies (`HostCopies.attach`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import torch

from slcompile.runtime.storage.tiers import TransferKind
from slcompile.runtime.weights import shard_group_of, update_weights, weight_home

__all__ = ["HostCopies", "LOW_PRECISION"]

LOW_PRECISION = (torch.bfloat16, torch.float16)


class HostCopies:
    """The host copy of each parameter, by the parameter.

    Args:
        names: each parameter's name in the model, by `id(param)`.
    """

    def __init__(self, names: Mapping[int, str]):
        self.names = names
        self._copies: dict[int, torch.Tensor] = {}
        self._loaded: dict[str, torch.Tensor] = {}  # loaded before the copy existed, by name
        self._taken: dict[str, tuple[torch.nn.Parameter, torch.Tensor]] = {}  # a model load in progress

    def get(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The host copy of `param`, made now if it has none (from the parameter's
        values, or from its stored weight when it holds no memory)."""
        copy = self._copies.get(id(param))
        if copy is not None:
            return copy
        home = weight_home(param)
        shards = shard_group_of(param)  # sharded: the copy is this rank's flat shard
        if home is None or param.untyped_storage().nbytes() > 0:
            values = param.detach() if shards is None else shards.shard(param)
        else:
            engine, stored_key, _ = home
            values = engine.wait(engine.load(stored_key, TransferKind.WEIGHT))
        dtype = torch.float32 if param.dtype in LOW_PRECISION else param.dtype
        copy = values.to(device="cpu", dtype=dtype, copy=True).view(param.shape if shards is None else -1)
        loaded = self._loaded.pop(self.names[id(param)], None)
        if loaded is not None:  # a whole weight, or this rank's padded shard already (`load_sharded`)
            if shards is not None and loaded.numel() != copy.numel():
                loaded = shards.shard(loaded)
            copy.copy_(loaded.reshape(copy.shape))
        self._copies[id(param)] = copy
        return copy

    def find(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The host copy of `param` if it has one."""
        return self._copies.get(id(param))

    def load(self, param: torch.nn.Parameter, values: torch.Tensor) -> bool:
        """Sets the host copy of `param` to `values`; True when the copy exists (the
        caller then writes it back), False when it is kept for the copy's making."""
        copy = self._copies.get(id(param))
        if copy is None:
            self._loaded[self.names[id(param)]] = values
            return False
        copy.copy_(values)
        return True

    def updates(self, params: Sequence[torch.nn.Parameter]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(parameter, the values its weight takes) for streamed `params`: the host
        copy, in the parameter's dtype."""
        updates = []
        for param in params:
            copy = self._copies[id(param)]
            engine, _, tier = weight_home(param)
            values = copy if copy.dtype == param.dtype else copy.to(param.dtype)
            if values is copy and engine.copies_nothing(engine.tier_of(copy), tier):
                # The tier would keep the copy itself, which the next step changes in place.
                values = copy.clone()
            updates.append((param, values))
        return updates

    def write_back(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Stores the host copies of streamed `params` as their weights, all or none."""
        update_weights(self.updates(params))

    def attach(self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter],
               wait: Callable[[], None]) -> list:
        """Routes `model.state_dict()` and `model.load_state_dict()` through the host
        copies of the streamed ones among `params` (a list the caller may extend);
        `wait` runs first (the steps in flight). Returns the hooks' handles."""
        state_hook = functools.partial(self._fill_model_state, params, wait)
        take_hook = functools.partial(self._take_model_state, params, wait)
        apply_hook = functools.partial(self._apply_model_state, params)
        return [model.register_state_dict_post_hook(state_hook),
                model.register_load_state_dict_pre_hook(take_hook),
                model.register_load_state_dict_post_hook(apply_hook)]

    def _fill_model_state(self, params, wait, module, state_dict, prefix, local_metadata) -> None:
        wait()
        for param in params:
            key = prefix + self.names[id(param)]
            if key in state_dict and weight_home(param) is not None:
                copy = self.get(param)
                shards = shard_group_of(param)
                if shards is not None:  # this rank's shard: every rank calls state_dict() together
                    copy = shards.wait(shards.all_gather(key, lambda: copy, param.shape))
                state_dict[key] = copy.to(dtype=param.dtype, copy=True)

    def _take_model_state(self, params, wait, module, state_dict, prefix, local_metadata, strict, missing,
                          unexpected, errors) -> None:
        wait()
        for param in params:
            key = prefix + self.names[id(param)]
            if key in state_dict and weight_home(param) is not None:
                # Copying into a parameter that holds no memory would write past its end.
                self._taken[key] = (param, state_dict.pop(key))

    def _apply_model_state(self, params, module, incompatible_keys) -> None:
        taken, self._taken = self._taken, {}
        for key in taken:
            if key in incompatible_keys.missing_keys:
                incompatible_keys.missing_keys.remove(key)
        streamed = []
        for param, values in taken.values():
            shards = shard_group_of(param)
            with torch.no_grad():
                self.get(param).copy_(values.reshape(param.shape) if shards is None else shards.shard(values))
            streamed.append(param)
        self.write_back(streamed)
        with torch.no_grad():
            for param in params:  # resident bf16/fp16 parameters: their fp32 copies follow
                copy = self._copies.get(id(param))
                if weight_home(param) is None and copy is not None:
                    copy.copy_(param.detach())
