"""Errors raised by the compiler side of slcompile."""

from __future__ import annotations

__all__ = [
    "RefusedError", "NoBlocksError", "BudgetError", "OptionError", "PolicyError", "OffloadError",
    "ReleasedWeightError", "CompileError", "OptionCompileError", "compile_error", "is_user_error",
    "passes_through_fallback", "as_refusal", "RecompileLimitWarning",
]


class RefusedError(Exception):
    """The pipeline cannot split this graph into sub-batches without changing results.

    Attributes:
        reason: one sentence a user understands, naming the node or input at fault.
        pass_name: the pass that refused.
        state: what the passes before it produced (a PipelineState), when raised by
            the pipeline.
    """

    def __init__(self, reason: str, pass_name: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.pass_name = pass_name
        self.state = None

    def __str__(self) -> str:
        where = f" [{self.pass_name}]" if self.pass_name else ""
        return f"{self.reason}{where}"


class NoBlocksError(RefusedError):
    """The graph has no repeated blocks: there is nothing to split. The backend
    compiles it with the plain lowering and says so; it is not a refusal, so
    `on_refusal="raise"` lets it through (the loss graph after a graph break)."""

    def __str__(self) -> str:
        return f"no blocks: compiled plainly ({self.reason})"


class BudgetError(Exception):
    """No plan of the step fits the device's memory budget.

    Attributes:
        budget: the `memory_budget` asked for, in bytes.
        smallest: the smallest device peak any plan reaches, in bytes: the smallest
            budget that compiles with these options.
        tried: the MemoryPrediction of every plan tried.
    """

    def __init__(self, budget: int, smallest: int, tried: tuple = ()):
        self.budget = budget
        self.smallest = smallest
        self.tried = tried
        from slcompile.units import format_bytes

        plans = "; ".join(f"recompute={p.recompute}: {p.peak_bytes['device']} bytes" for p in tried)
        plans = f" [{plans}]" if plans else ""
        super().__init__(
            f"the step needs at least {smallest} bytes ({format_bytes(smallest)}) on the device, "
            f"over memory_budget={budget} ({format_bytes(budget)}); set memory_budget >= {smallest}, "
            f"or lower it with more sub-batches, recompute='blocks', activations='nvme' or "
            f"weights='nvme'{plans}"
        )


class OptionError(ValueError):
    """A bad `torch.compile(..., options=...)` key or value; the message names the
    option and how to fix it."""


class ProfileError(OptionError):
    """A measured machine profile that `explain`, `tune` or `compare_policies` would
    predict from was measured under load or with widely spread repeats
    (`MachineProfile.trust_problem`): the message says which, and how to remeasure
    or to use it anyway."""


class PolicyError(OptionError):
    """A schedule policy (the `schedule` option) wrote a schedule the passes cannot
    compile as written: not a `Schedule`, a compute step missing or repeated, a
    transfer of something that does not exist, a wait before its issue, a step that
    uses data before it arrives; or the compiled graphs run another schedule than the
    one it wrote. Raised before anything runs, never a fallback: the message names the
    policy and the offending step's text line (`Step.text()`).

    Attributes:
        policy: the policy's name.
        step: the offending step's text line, or None when no one step is at fault.
        problem: what is wrong, in words.
    """

    def __init__(self, policy: str, problem: str, step: str | None = None):
        self.policy = policy
        self.step = step
        self.problem = problem
        where = f" at step `{step}`" if step is not None else ""
        super().__init__(f"schedule policy {policy!r}{where}: {problem}")


class RecompileLimitWarning(UserWarning):
    """Dynamo hit its recompile limit on a frame it would have compiled with the
    speedloader backend, so the frame runs eagerly: every call of a model compiled in
    a sweep of configurations without `torch._dynamo.reset()` between them, from the
    limit on. The message names the frame, the options and the fix."""


def _dynamo_exc():
    from torch._dynamo import exc

    return exc


class CompileError(_dynamo_exc().BackendCompilerFailed):
    """What the speedloader backend raises through `torch.compile` for a problem the
    user can fix (a bad option, an unusable `offload_dir`, a budget no plan meets, a
    refused graph with `on_refusal="raise"`).

    Dynamo wraps what a backend raises in `BackendCompilerFailed`, whose message
    starts with the backend's name, and appends its own hints for reporting bugs to
    PyTorch. This subclass is re-raised by Dynamo as it is, so the first line of the
    message is the cause's own, and the traceback starts at the backend.

    Attributes:
        inner_exception: the cause, whose message this one repeats.
    """

    def __init__(self, cause: Exception, first_useful_frame=None):
        _dynamo_exc().ShortenTraceback.__init__(self, str(cause), first_useful_frame=first_useful_frame)
        self.backend_name = "speedloader"
        self.inner_exception = cause

    # Dynamo appends "Set TORCHDYNAMO_VERBOSE=1 ... reporting a bug to PyTorch" to any
    # exception carrying `real_stack`, which it attaches on the way out; the stack is
    # Dynamo's own and the hint is wrong for a user error, so the attribute never sticks.
    @property
    def real_stack(self):
        raise AttributeError("real_stack")

    @real_stack.setter
    def real_stack(self, value) -> None:
        pass

    # Newer Dynamo appends the same hint to every `ShortenTraceback` through `args`,
    # stack or not; the hint is cut as it is written.
    @property
    def args(self):
        return BaseException.args.__get__(self)

    @args.setter
    def args(self, value) -> None:
        if value and isinstance(value[0], str):
            value = (_without_dynamo_hint(value[0]), *value[1:])
        BaseException.args.__set__(self, value)


def _without_dynamo_hint(message: str) -> str:
    """`message` without the "Set TORCHDYNAMO_VERBOSE=1 ... reporting a bug to
    PyTorch ..." paragraph Dynamo appends to exceptions on their way out."""
    start = message.find("\nSet TORCHDYNAMO_VERBOSE=1")
    if start < 0:
        return message
    end = message.find("\n", start + 1)
    return message[:start] + ("" if end < 0 else message[end:].rstrip("\n"))


class OptionCompileError(CompileError, ValueError):
    """A `CompileError` whose cause is a bad option: also a `ValueError`."""


def compile_error(cause: Exception, first_useful_frame=None) -> CompileError:
    """The `CompileError` for `cause` (an `OptionCompileError` for a ValueError)."""
    kind = OptionCompileError if isinstance(cause, ValueError) else CompileError
    return kind(cause, first_useful_frame)


class OffloadError(RuntimeError):
    """Base class of every runtime transfer and storage failure.

    Args:
        message: What went wrong, in words.
        key: The tensor key the failure concerns, if any.
        path: The file or directory involved, if any.
    """

    def __init__(self, message: str, *, key: str | None = None, path: str | None = None):
        self.reason = message
        self.key = key
        self.path = path
        parts = [message]
        if key is not None:
            parts.append(f"tensor key {key!r}")
        if path is not None:
            parts.append(f"path {path!r}")
        super().__init__("; ".join(parts))

    def with_key(self, key: str) -> "OffloadError":
        """Returns the same kind of error, naming ``key`` as well."""
        if self.key is not None:
            return self
        error = type(self)(self.reason, key=key, path=self.path)
        error.__cause__ = self.__cause__ or self
        return error


class ReleasedWeightError(RuntimeError):
    """Code outside `slcompile.gathered_weights(model)` used the values of a parameter
    whose storage is released (its weight rests on a slower tier).

    Attributes:
        parameter: the parameter's name, as the compiled graph or `generate` knows it.
        tier: the tier the weight rests on ("nvme", "host").
    """

    def __init__(self, parameter: str, tier: str, what: str = ""):
        self.parameter = parameter
        self.tier = tier
        used = f" ({what})" if what else ""
        super().__init__(
            f"parameter {parameter} rests on the {tier} tier and holds no memory{used}; read or "
            f"update it inside slcompile.gathered_weights(model), or step it with slcompile.offload_optimizer"
        )


def is_user_error(err: BaseException) -> bool:
    """Errors the user must see and act on, never a fallback to plain compilation:
    a bad option, a memory budget no plan meets, an unusable offload directory, a
    full disk (every offload storage failure)."""
    return isinstance(err, (OptionError, BudgetError, OffloadError))


def passes_through_fallback(err: BaseException) -> bool:
    """Failures no fallback may turn into a plain compile: the user's own
    (`is_user_error`), and Dynamo's signal to trace the frame again
    (`RestartAnalysis`: with `dynamic=True`, the graph a scalar becomes a tensor in)."""
    import torch._dynamo.exc

    return is_user_error(err) or isinstance(err, torch._dynamo.exc.RestartAnalysis)


def as_refusal(err: Exception, stage: str) -> RefusedError:
    """The refusal a failure of any compile stage becomes: the backend compiles the
    graph plainly with its reason (or raises it with `on_refusal="raise"`).

    Args:
        err: what a stage raised (not a user error: see `is_user_error`).
        stage: where, in words, when `err` does not say (a pass's error does:
            "internal error in pass fuse_weight_grads (partitioned stage; ...)").

    Returns:
        `err` itself when it is a RefusedError, else a RefusedError naming the stage
        and the error (its first line), caused by `err`.
    """
    if isinstance(err, RefusedError):
        return err
    pass_name = getattr(err, "pass_name", "")
    if pass_name:  # a PassError: its message names the pass, the stage and the passes run
        reason = str(err)
    else:
        lines = str(err).strip().splitlines()
        message = lines[0] if lines else ""
        if len(message) > 300:
            message = message[:300] + "..."
        reason = f"{stage} failed ({type(err).__name__}: {message})"
    refusal = RefusedError(reason, pass_name)
    refusal.__cause__ = err
    return refusal
