"""The offloaded optimizer (`offload_optimizer`, `OffloadedOptimizer`): a
`torch.optim.Optimizer` that takes the streamed weights' gradients as the backward
stores them, steps each block on a worker thread once its gradients are in
(`host_step`), closes every step all or nothing, and steps the parameters that stay
on the device itself. What it needs and guarantees: `slcompile.optim`'s docstring."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from slcompile.optim.checks import check_optimizer_class, check_state_size, refuse_lightning_clip
from slcompile.optim.host_copies import LOW_PRECISION, HostCopies
from slcompile.optim.host_step import _copy, _HostStep, _options, _take_options
from slcompile.runtime import gradients as gradient_runtime
from slcompile.runtime.storage.engine import TransferEngine, get_engine
from slcompile.runtime.errors import OffloadError
from slcompile.runtime.storage.tiers import Tier
from slcompile.runtime.weights import (
    StagedWeight,
    commit_weights,
    discard_weights,
    fetch_issue,
    shard_group_of,
    stage_weights,
    weight_home,
)

__all__ = ["OffloadedOptimizer", "offload_optimizer", "attached_optimizer_memory"]

log = logging.getLogger(__name__)

_TIERS = ("host", "nvme")
_MASTER = "fp32_master"  # the state_dict entry of a bf16/fp16 parameter's fp32 copy


def offload_optimizer(
    model: torch.nn.Module,
    optimizer_class: type[torch.optim.Optimizer],
    *,
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]] | None = None,
    states: str = "host",
    gradients: str = "host",
    max_grad_norm: float | None = None,
    **optimizer_options: Any,
) -> OffloadedOptimizer:
    """An optimizer for `model` whose step for streamed block weights runs off the device.

    Create it before the first call of the compiled model, so the compiled backward
    sends the gradients to it (`SpeedLoaderConfig.gradients="auto"`).

    Args:
        model: the model (its parameters that require grad are optimized).
        optimizer_class: a `torch.optim.Optimizer` subclass with a per-parameter update.
        params: what to optimize, as for `optimizer_class`: parameters of `model`, or
            param groups (dicts with "params" and per-group options, such as no
            weight decay for norms and biases); default: every parameter of `model`
            that requires grad.
        states: where the optimizer state of streamed weights rests: "host" or "nvme".
        gradients: where the backward sends the gradients of streamed weights:
            "host" or "nvme" (on a CPU-only machine "host" moves no bytes).
        max_grad_norm: clip the gradients to this total 2-norm before stepping, as
            `torch.nn.utils.clip_grad_norm_(params, max_grad_norm)` would (the norm
            is `last_grad_norm` after each step). The block steps then wait for
            `step()`: see `slcompile.optim`'s docstring.
        **optimizer_options: passed to `optimizer_class` (lr, betas, weight_decay, ...).

    Returns:
        the optimizer.

    Raises:
        ValueError: an optimizer whose step needs every gradient at once, or a bad tier.
    """
    return OffloadedOptimizer(model, optimizer_class, params=params, states=states, gradients=gradients,
                              max_grad_norm=max_grad_norm, **optimizer_options)


class OffloadedOptimizer(torch.optim.Optimizer):
    """See `slcompile.optim`'s docstring; built by `offload_optimizer`.

    A `torch.optim.Optimizer`: `param_groups` holds the model's parameters and each
    group's options, which every step reads (the block steps included), so
    `torch.optim.lr_scheduler` schedulers and code that sets `group["lr"]` work as
    with `optimizer_class` itself. The optimizer state is not in `state`: read it
    with `state_dict()`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        *,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]] | None = None,
        states: str = "host",
        gradients: str = "host",
        max_grad_norm: float | None = None,
        **optimizer_options: Any,
    ):
        check_optimizer_class(optimizer_class)
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"offload_optimizer: max_grad_norm must be a positive number or None, "
                             f"got {max_grad_norm!r}")
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: torch.Tensor | None = None  # the total norm before clipping, with max_grad_norm
        for name, value in (("states", states), ("gradients", gradients)):
            if value not in _TIERS:
                raise ValueError(f"offload_optimizer: {name} must be one of {_TIERS}, got {value!r}")
        self.optimizer_class = optimizer_class
        self.optimizer_options = dict(optimizer_options)
        self.states_tier = Tier(states)
        self.gradient_tier = Tier(gradients)
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._ready = False
        self._group_index: dict[int, int] = {}  # id(param) -> index in param_groups
        # torch checks the options and fills in the class's defaults.
        defaults = optimizer_class([torch.zeros(1, requires_grad=True)], **optimizer_options).defaults
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(params, defaults)
        self.params = [p for group in self.param_groups for p in group["params"]]
        self._loaded_state: dict[str, dict[str, Any]] = {}  # from load_state_dict, not installed yet
        self._lock = threading.Lock()
        self._copies = HostCopies(self._names)  # what the host steps update
        self._host_steps: dict[tuple[int, ...], _HostStep] = {}
        self._arrivals: dict[tuple[str, int | None], dict[str, tuple[torch.nn.Parameter, Any]]] = {}
        self._stepped: set[int] = set()
        self._pending: list[concurrent.futures.Future] = []
        # The step in progress, all or nothing: blocks stepped on the host whose new
        # weights and states are written beside the previous ones, which `step()` puts
        # in place once every block succeeded (or back, when one failed); and the next
        # forward's prefetches of their weights, issued after that.
        self._open: list[tuple[_HostStep, list[StagedWeight]]] = []
        self._deferred_issues: list[str] = []
        self._resident: torch.optim.Optimizer | None = None
        self._resident_groups: list[int] = []
        # With max_grad_norm: blocks whose gradients are in, waiting for step(), and
        # the 2-norm of each of their gradients.
        self._received: list[tuple[Any, dict[str, tuple[torch.nn.Parameter, Any]], list[torch.nn.Parameter]]] = []
        self._norms: dict[int, torch.Tensor] = {}
        self._warned_fallback = False
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="slc-optimizer")
        # Parameters already offloaded (a model compiled before): copy them now, once.
        for param in self.params:
            if weight_home(param) is not None:
                self._copies.get(param)
        gradient_runtime.attach_consumer(self.params, self)
        self._hooks = self._copies.attach(model, self.params, self.wait)
        self._ready = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group of the model's parameters with its own options (torch's rules).

        Raises:
            ValueError: a parameter that is not the model's, or already in a group.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        foreign = [p for p in group["params"] if id(p) not in self._names]
        if foreign:
            self.param_groups.pop()
            raise ValueError(f"offload_optimizer: {len(foreign)} parameters of a param group are not "
                             "parameters of the model the optimizer was made for")
        for param in group["params"]:
            self._group_index[id(param)] = len(self.param_groups) - 1
        if not self._ready:
            return
        # Added after the model was compiled: their gradients come back as .grad.
        self.params.extend(group["params"])
        for param in group["params"]:
            if weight_home(param) is not None:
                self._copies.get(param)
        gradient_runtime.attach_consumer(group["params"], self)

    # -- gradient consumer ------------------------------------------------
    def prepare(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Host copies of parameters whose gradients will arrive, while they hold values."""
        for param in params:
            self._copies.get(param)

    def gradient_arrived(self, sink, stored_key: str, param: torch.nn.Parameter, handle) -> None:
        """Records a gradient store; submits the block's step once the block is complete."""
        block = sink.block_of[stored_key]
        with self._lock:
            if id(param) in self._stepped:
                raise OffloadError(
                    "a second backward before optimizer.step(): the offloaded optimizer steps each "
                    "block once its gradient arrives, so gradients cannot accumulate across backward "
                    "calls (split the batch with num_subbatches instead, or call step() between them)",
                    key=stored_key,
                )
            group = self._arrivals.setdefault((sink.name, block), {})
            group[stored_key] = (param, handle)
            expected = {k for k in sink.block_keys(stored_key)
                        if gradient_runtime.consumer_of(sink.params[k]) is self}
            if not expected <= group.keys():
                return
            del self._arrivals[(sink.name, block)]
            self._stepped.update(id(p) for p, _ in group.values())
            task = self._step_block if self.max_grad_norm is None else self._receive_for_clip
            self._pending.append(self._worker.submit(task, sink, group))

    # -- the optimizer API ------------------------------------------------
    def step(self, closure: Callable | None = None) -> Any:
        """Waits for the block steps still running, then steps every other parameter.
        With `max_grad_norm`: computes the clip factor, then runs the block steps.

        Args:
            closure: as torch's optimizers take it, the forward and the backward
                of this step (Lightning passes one in automatic optimization): run
                first, under `torch.enable_grad()`; the blocks step as their
                gradients arrive during it.

        Returns:
            what `closure` returned (the loss), or None without one.

        Raises:
            DiskFullError: no room for a block's updated weights (that block's step is
                undone) or nvme states; see `slcompile.optim`'s docstring.
            ValueError: `closure` is Lightning's and its Trainer clips gradients
                (`gradient_clip_val`), which would clip only the resident
                parameters' `.grad`: clip with `max_grad_norm` instead.
        """
        loss = None
        if closure is not None:
            refuse_lightning_clip(closure)
            with torch.enable_grad():
                loss = closure()
        self._step()
        return loss

    def _step(self) -> None:
        """`step()` once the gradients are in (or arriving)."""
        try:
            self._step_blocks()
        except BaseException:
            self._close_step(commit=False)
            raise
        self._close_step(commit=True)
        resident = [p for p in self.params if weight_home(p) is None]
        low_precision = [p for p in resident if p.dtype in LOW_PRECISION and p.grad is not None]
        if low_precision:
            self._step_low_precision(low_precision)
        resident = [p for p in resident if p.dtype not in LOW_PRECISION]
        if not resident:
            return
        if self._resident is None:
            groups, self._resident_groups = self._groups(resident, resident)
            self._resident = self.optimizer_class(groups, **self.optimizer_options)
            self._install_resident_state()
        _take_options(self._resident, self._resident_groups, self.param_groups)
        self._resident.step()

    def _step_blocks(self) -> None:
        """Everything of `step()` that writes to a tier: the block steps (waited for, or
        run here with max_grad_norm) and the steps from `.grad`; each block's new
        weights and states are staged, not yet in place."""
        try:
            self.wait()
        except BaseException:
            with self._lock:  # blocks received for a clip that will not happen
                self._received.clear()
                self._norms.clear()
            raise
        finally:
            # A failed block step (a full disk) leaves the next backward free to run.
            with self._lock:
                missing = {key for group in self._arrivals.values() for key in group}
                self._arrivals.clear()
                self._stepped.clear()
        if missing:
            with self._lock:
                self._received.clear()
                self._norms.clear()
            raise OffloadError(f"the gradients of {len(missing)} weights arrived without the rest of "
                               "their block (a backward that failed part way); no weight was stepped")
        self._average_replicated_grads()
        if self.max_grad_norm is not None:
            self._clip_and_step_blocks()
        self._step_from_grad()

    def _close_step(self, commit: bool) -> None:
        """Ends the step of the blocks: their staged weights and states replace the
        previous ones (renames: nothing that can fail for room), or, when any block
        failed, are dropped and every block's host copies and state go back to before
        the step; then the next forward's prefetches are issued."""
        with self._lock:
            opened, self._open = self._open, []
            issues, self._deferred_issues = self._deferred_issues, []
        try:
            for host_step, staged in opened:
                if commit:
                    commit_weights(staged)
                    host_step.commit()
                else:
                    discard_weights(staged)
                    host_step.roll_back()
        finally:
            for graph_key in issues:
                fetch_issue(graph_key, gather=False)  # sharded: the fetch all-gathers, in graph order

    def memory(self, streamed: Iterable[Iterable[torch.Tensor]], machine=None):
        """This optimizer's share of a step's memory per tier
        (`slcompile.analysis.optimizer_memory`) when `streamed` are the
        model's streamed weights, per block; its other parameters step on the device.

        Args:
            streamed: the streamed parameters, grouped by block; those this
                optimizer does not hold (frozen weights) have no host copy, state
                or gradient.
            machine: the machine's facts (`MachineFacts`); default: this machine's,
                with the streamed weights' shard group's ranks.
        """
        from slcompile.analysis.optimizer_memory import optimizer_memory

        held = {id(p) for p in self.params}
        blocks = [[p for p in block if id(p) in held] for block in streamed]
        off = {id(p) for block in streamed for p in block}
        blocks = [block for block in blocks if block]
        resident = [[p for p in group["params"] if id(p) not in off] for group in self.param_groups]
        # The class's options as the first group has them; weight decay where any group has it.
        options = {key: self.param_groups[0][key] for key in self.defaults if key in self.param_groups[0]}
        decays = [group.get("weight_decay", 0) for group in self.param_groups]
        if any(decays):
            options["weight_decay"] = next(decay for decay in decays if decay)
        if machine is None:
            from slcompile.facts import machine_facts

            shards = next((g for g in (shard_group_of(p) for block in blocks for p in block) if g is not None), None)
            machine = machine_facts(world_size=shards.world_size if shards is not None else 1)
        return optimizer_memory(self.optimizer_class, options, resident, blocks,
                                states=self.states_tier.value, max_grad_norm=self.max_grad_norm, machine=machine)

    def wait(self) -> None:
        """Blocks until the block steps submitted so far are done; re-raises their errors."""
        with self._lock:
            pending, self._pending = self._pending, []
        # Every block step finishes before the first error is raised: one still running
        # would go on writing its files behind the caller's back.
        concurrent.futures.wait(pending)
        for future in pending:
            future.result()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the `.grad` of the parameters that keep one (streamed weights have none)."""
        for param in self.params:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_()
                param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state of every parameter, by parameter name, on the host.

        Read block by block from where it rests (host memory or nvme files); the
        layout does not depend on the blocks, so a fresh optimizer loads it.
        """
        self.wait()
        state: dict[str, dict[str, Any]] = {name: dict(values) for name, values in self._loaded_state.items()}
        for host_step in self._host_steps.values():
            for index, param in enumerate(host_step.params):
                state[self._names[id(param)]] = host_step.state_of(index)
        if self._resident is not None:
            for param, values in self._resident.state.items():
                state[self._names[id(param)]] = {k: _copy(v) for k, v in values.items()}
        for param in self.params:
            master = self._copies.find(param)
            if master is not None and master.dtype != param.dtype:
                state.setdefault(self._names[id(param)], {})[_MASTER] = master.clone()
        groups = [{**_options(group), "params": [self._names[id(p)] for p in group["params"]]}
                  for group in self.param_groups]
        return {"optimizer": self.optimizer_class.__name__, "options": dict(self.optimizer_options),
                "param_groups": groups, "state": state}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads what `state_dict` returned; parameters not stepped yet take it at their first step.

        It carries the fp32 copies of bf16/fp16 parameters: load the model's state
        first, then this one.

        Raises:
            ValueError: the state of another optimizer class.
        """
        if state_dict.get("optimizer") != self.optimizer_class.__name__:
            raise ValueError(f"load_state_dict: this is a {state_dict.get('optimizer')} state, "
                             f"not a {self.optimizer_class.__name__} one")
        groups = state_dict.get("param_groups")
        if groups is not None:
            mine = [[self._names[id(p)] for p in group["params"]] for group in self.param_groups]
            if [list(group["params"]) for group in groups] != mine:
                raise ValueError("load_state_dict: the state's param groups hold other parameters than this "
                                 "optimizer's (make the optimizer with the same params= groups)")
        self.wait()
        for group, saved in zip(self.param_groups, groups or ()):
            group.update(_options(saved))
        self._loaded_state = {name: dict(values) for name, values in state_dict["state"].items()}
        by_name = {self._names[id(p)]: p for p in self.params}
        updated = []
        for name, values in self._loaded_state.items():
            master = values.pop(_MASTER, None)
            if master is None:
                continue
            if self._copies.load(by_name[name], master):
                updated.append(by_name[name])
        self._copies.write_back([p for p in updated if weight_home(p) is not None])
        with torch.no_grad():
            for param in updated:
                if weight_home(param) is None:
                    param.copy_(self._copies.get(param))
        self._loaded_state = {name: values for name, values in self._loaded_state.items() if values}
        for host_step in self._host_steps.values():
            for index, param in enumerate(host_step.params):
                values = self._loaded_state.pop(self._names[id(param)], None)
                if values is not None:
                    check_state_size(param, self._names[id(param)], values, host_step.masters[index])
                    host_step.set_state(index, values)
        if self._resident is not None:
            self._install_resident_state()

    def host_copy(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The host copy of a streamed parameter the optimizer steps (its master values):
        this rank's flat, zero-padded shard when the weight is sharded
        (`shard_weights`), else a tensor of the parameter's shape. Change it in place,
        then `store_host_copies` writes it to the weight's tier."""
        self.wait()
        return self._copies.get(param)

    def store_host_copies(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Writes the host copies of streamed `params` to their weights' tier, all or none."""
        self._copies.write_back([p for p in params if weight_home(p) is not None])

    def close(self) -> None:
        """Finishes running steps, detaches from the model and frees stored states."""
        try:
            self.wait()
        finally:
            self._close_step(commit=False)  # blocks stepped for a step() that never came
        gradient_runtime.attach_consumer(self.params, None)
        for hook in self._hooks:
            hook.remove()
        self._worker.shutdown(wait=True)
        for host_step in self._host_steps.values():
            host_step.free()

    # -- internals --------------------------------------------------------
    def _average_replicated_grads(self) -> None:
        """With sharded weights (`shard_weights`): the `.grad` of the parameters every
        rank keeps whole, averaged over the ranks (an all-reduce each, in the same
        order on every rank) before they step."""
        shards = self._shard_group()
        if shards is None:
            return
        handles = [shards.all_reduce(self._names[id(p)], p.grad) for p in self.params
                   if p.grad is not None and shard_group_of(p) is None]
        for handle in handles:
            shards.wait(handle)

    def _shard_group(self):
        """The `ShardGroup` of the sharded weights (`shard_weights`); None without."""
        return next((g for g in map(shard_group_of, self.params) if g is not None), None)

    def _install_resident_state(self) -> None:
        for group in self._resident.param_groups:
            for param in group["params"]:
                values = self._loaded_state.pop(self._names[id(param)], None)
                if values is not None:
                    self._resident.state[param] = {k: _copy(v) for k, v in values.items()}

    def _host_step(self, params: list[torch.nn.Parameter], engine: TransferEngine) -> _HostStep:
        key = tuple(id(p) for p in params)
        host_step = self._host_steps.get(key)
        if host_step is None:
            masters = [self._copies.get(p) for p in params]
            groups, group_ids = self._groups(params, masters)
            optimizer = self.optimizer_class(groups, **self.optimizer_options)
            host_step = _HostStep(optimizer, params, masters, self.states_tier, engine,
                                  f"opt{id(self):x}.{len(self._host_steps)}", group_ids, self.param_groups,
                                  [self._names[id(p)] for p in params])
            for index, param in enumerate(params):
                values = self._loaded_state.pop(self._names[id(param)], None)
                if values is not None:
                    check_state_size(param, self._names[id(param)], values, masters[index])
                    host_step.set_state(index, values)
            self._host_steps[key] = host_step
        return host_step

    def _groups(self, params: list[torch.nn.Parameter], values: list[torch.Tensor]
                ) -> tuple[list[dict[str, Any]], list[int]]:
        """Param groups of an optimizer over `values` (the parameters or their host
        copies), with the options of the groups `params` belong to; and those groups'
        indices in `param_groups`."""
        by_group: dict[int, list[torch.Tensor]] = {}
        for param, value in zip(params, values):
            by_group.setdefault(self._group_index[id(param)], []).append(value)
        indices = sorted(by_group)
        return [{**_options(self.param_groups[i]), "params": by_group[i]} for i in indices], indices

    def _step_block(self, sink, group: dict[str, tuple[torch.nn.Parameter, Any]]) -> None:
        """On the worker: the gradients of one block, its step, its weights' update."""
        self._finish_block(sink, group, self._receive_block(sink, group))

    def _receive_block(self, sink, group: dict[str, tuple[torch.nn.Parameter, Any]]) -> list[torch.nn.Parameter]:
        """On the worker: the gradients of one block, as the `.grad` of its host copies."""
        engine = sink.engine
        params = []
        for stored_key in sorted(group):
            param, handle = group[stored_key]
            engine.wait(handle)
            grad = sink.take(stored_key)
            master = self._copies.get(param)
            master.grad = grad.to(device=master.device, dtype=master.dtype).view(master.shape)
            params.append(param)
        return params

    def _receive_for_clip(self, sink, group: dict[str, tuple[torch.nn.Parameter, Any]]) -> None:
        """On the worker, with max_grad_norm: the first phase of a block (its gradients
        and their norms); `step()` runs the second once every norm is in."""
        params = self._receive_block(sink, group)
        norms = {id(p): torch.linalg.vector_norm(self._copies.get(p).grad, 2.0) for p in params}
        with self._lock:
            self._norms.update(norms)
            self._received.append((sink, group, params))

    def _clip_and_step_blocks(self) -> None:
        """The clip factor from every gradient's norm (blocks received on the host, the
        others' `.grad`), then the block steps with their gradients scaled by it."""
        with self._lock:
            received, self._received = self._received, []
            norms, self._norms = self._norms, {}
        for param in self.params:
            if param.grad is not None:
                norms[id(param)] = torch.linalg.vector_norm(param.grad.detach().float(), 2.0).cpu()
        ordered = [norms[id(p)].float() for p in self.params if id(p) in norms]
        if not ordered:
            return
        shards = self._shard_group()
        if shards is None:
            total = torch.linalg.vector_norm(torch.stack(ordered), 2.0)
        else:
            total = self._sharded_norm(shards, norms)
        self.last_grad_norm = total
        scale = torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
        for param in self.params:
            if param.grad is not None:
                param.grad.detach().mul_(scale.to(param.grad.device))
        futures = [self._worker.submit(self._finish_block, sink, group, params, scale)
                   for sink, group, params in received]
        concurrent.futures.wait(futures)
        for future in futures:
            future.result()

    def _sharded_norm(self, shards, norms: dict[int, torch.Tensor]) -> torch.Tensor:
        """The total norm over every rank's gradient shards (`shard_weights`): the
        squared norms of this rank's shards (their padding is zeros) summed over the
        ranks by one all-reduce, plus those of the replicated `.grad`, counted once
        (every rank holds the same average)."""
        sharded = [norms[id(p)].float() for p in self.params if id(p) in norms and shard_group_of(p) is not None]
        replicated = [norms[id(p)].float() for p in self.params if id(p) in norms and shard_group_of(p) is None]
        squares = torch.stack(sharded).square().sum() if sharded else torch.zeros(())
        # The all-reduce averages; scaled back, every rank holds the same sum.
        squares = shards.wait(shards.all_reduce("grad_norm", squares.reshape(1))) * shards.world_size
        if replicated:
            squares = squares + torch.stack(replicated).square().sum()
        return squares.sqrt().reshape(())

    def _finish_block(self, sink, group: dict[str, tuple[torch.nn.Parameter, Any]],
                      params: list[torch.nn.Parameter], scale: torch.Tensor | None = None) -> None:
        """On the worker: the step of a block whose gradients are in, its weights' update."""
        engine = sink.engine
        if scale is not None:
            for param in params:
                self._copies.get(param).grad.mul_(scale)
        staged = self._fallible(params, engine)
        try:
            self._step_and_update(params, engine)
        finally:
            issues = [graph_key for stored_key in sorted(group) for graph_key in sink.deferred_issues.get(stored_key, ())]
            if staged:
                # The weights change when `step()` puts the staged ones in place: load them after that.
                with self._lock:
                    self._deferred_issues.extend(issues)
            else:
                for graph_key in issues:
                    fetch_issue(graph_key, gather=False)  # sharded: the fetch all-gathers, in graph order

    def _step_from_grad(self) -> None:
        """Streamed weights whose gradient came back as `.grad` (compiled before this
        optimizer existed): the same host step, from the `.grad`."""
        params = [p for p in self.params if p.grad is not None and weight_home(p) is not None]
        if not params:
            return
        if not self._warned_fallback:
            log.info("offload_optimizer: %d streamed weights came back with a .grad (the model was compiled "
                     "before the optimizer existed); stepping them from it", len(params))
            self._warned_fallback = True
        errors = []
        for param in params:
            master = self._copies.get(param)
            master.grad = param.grad.detach().to(device=master.device, dtype=master.dtype)
            param.grad = None
            try:
                self._step_and_update([param], weight_home(param)[0])
            except OffloadError as error:
                errors.append(error)
        _raise_first(errors)

    def _step_low_precision(self, params: list[torch.nn.Parameter]) -> None:
        """Resident bf16/fp16 parameters: the step runs on their fp32 host copies too,
        and the device keeps the rounded result."""
        for param in params:
            master = self._copies.get(param)
            master.grad = param.grad.detach().to(device=master.device, dtype=master.dtype)
        error = self._host_step(params, get_engine()).step()
        with torch.no_grad():
            for param in params:
                param.copy_(self._copies.get(param))
        _raise_first([error])

    def _fallible(self, params: list[torch.nn.Parameter], engine: TransferEngine) -> bool:
        """Whether the step of `params` writes bytes somewhere (nvme states, weights on
        a tier that copies): only then can it fail part way, for room or an I/O error."""
        return self.states_tier is Tier.NVME or any(
            not engine.copies_nothing(Tier.HOST, weight_home(p)[2]) for p in params)

    def _step_and_update(self, params: list[torch.nn.Parameter], engine: TransferEngine) -> None:
        """The host step of `params` and the update of their weights. When any of it
        writes bytes (`_fallible`), the new weights and states are staged beside the
        previous ones and the block joins the open step, which `step()` closes, all
        blocks or none; a block that fails here goes back to before its step at once
        (host copies, state) and the error is raised. Otherwise the update is in
        place when this returns."""
        host_step = self._host_step(params, engine)
        if not self._fallible(params, engine):
            error = host_step.step()
            self._copies.write_back(params)
            _raise_first([error])
            return
        host_step.step(keep_previous=True)
        try:
            staged = stage_weights(self._copies.updates(params))
        except BaseException:
            host_step.roll_back()
            raise
        with self._lock:
            self._open.append((host_step, staged))


def attached_optimizer_memory(params: Iterable[torch.Tensor], streamed: Iterable[Iterable[torch.Tensor]],
                              machine=None):
    """`OffloadedOptimizer.memory` of the offloaded optimizer that holds any of
    `params` (a compiled graph's parameters), or None when none does; `machine` as
    for `OffloadedOptimizer.memory`."""
    for param in params:
        consumer = gradient_runtime.consumer_of(param)
        if isinstance(consumer, OffloadedOptimizer):
            return consumer.memory(streamed, machine)
    return None


def _raise_first(errors: Iterable[OffloadError | None]) -> None:
    for error in errors:
        if error is not None:
            raise error
