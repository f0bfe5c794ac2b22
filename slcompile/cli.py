"""`slcompile demo | explain`: the command line.

`slcompile demo` trains a small GPT for a few steps with the speedloader backend next
to eager PyTorch and prints the schedule and both losses. `slcompile explain
module:factory` prints what the backend would do with a model: `factory()` returns
`(model, args)` or `(model, args, kwargs)`. Errors print one line and exit non-zero;
`--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import logging
import sys
import time

import torch

from slcompile.config import SpeedLoaderConfig

__all__ = ["main"]


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config option (`--num-subbatches 4`), documented from the dataclass."""
    doc = SpeedLoaderConfig.__doc__ or ""
    for field in dataclasses.fields(SpeedLoaderConfig):
        flag = "--" + field.name.replace("_", "-")
        help_text = _field_doc(doc, field.name)
        kind = type(field.default)
        parser.add_argument(flag, dest=field.name, type=kind, default=None, help=f"{help_text} (default: {field.default})")


def _field_doc(doc: str, name: str) -> str:
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith(f"{name}:"):
            text = [line.strip()[len(name) + 1 :].strip()]
            for follow in lines[i + 1 :]:
                if not follow.startswith(" " * 12):
                    break
                text.append(follow.strip())
            return " ".join(text).replace("%", "%%")
    return ""


def _options(args: argparse.Namespace, **defaults) -> dict:
    options = dict(defaults)
    for field in dataclasses.fields(SpeedLoaderConfig):
        value = getattr(args, field.name)
        if value is not None:
            options[field.name] = value
    return options


def _demo(args: argparse.Namespace) -> int:
    from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch
    from slcompile.report import compile_reports

    options = _options(args, num_subbatches=4)
    config = SpeedLoaderConfig.from_options(options)
    torch.manual_seed(0)
    model_config = GPTConfig(n_layers=args.layers, d_model=args.width, seq_len=args.seq_len, vocab_size=256)
    eager = TinyGPT(model_config)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="speedloader", options=options)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (eager, model)]
    print(
        f"slcompile demo: GPT with {args.layers} blocks, d_model {args.width}, batch {args.batch}, "
        f"K={config.num_subbatches}, lowering {config.lowering}"
    )
    for step in range(args.steps):
        idx, targets = make_gpt_batch(model_config, args.batch, seed=step)
        losses = []
        started = time.perf_counter()
        for runner, optimizer in zip((eager, compiled), optimizers):
            optimizer.zero_grad()
            _, loss = runner(idx, targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        took = time.perf_counter() - started
        if step == 0:
            report = compile_reports()[-1]
            if report.fallback_reason:
                print(f"fallback: {report.fallback_reason}")
            else:
                print(f"blocks: {', '.join(report.blocks)}")
                print("schedule:")
                print("\n".join("  " + line for line in report.schedule.splitlines()))
        print(f"step {step}: loss speedloader {losses[1]:.6f}  eager {losses[0]:.6f}  |diff| {abs(losses[1] - losses[0]):.2e}  ({took:.1f} s)")
    return 0


def _load_target(target: str):
    if ":" not in target:
        raise ValueError(f"TARGET must be module:factory, got {target!r}")
    module_name, factory_name = target.split(":", 1)
    module = importlib.import_module(module_name)
    factory = getattr(module, factory_name, None)
    if factory is None:
        raise ValueError(f"{module_name} has no attribute {factory_name!r}")
    made = factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise ValueError(f"{target}() must return (model, args) or (model, args, kwargs)")
    model, call_args = made[0], tuple(made[1])
    call_kwargs = dict(made[2]) if len(made) == 3 else {}
    return model, call_args, call_kwargs


def _explain(args: argparse.Namespace) -> int:
    from slcompile.explain import explain

    model, call_args, call_kwargs = _load_target(args.target)
    explanation = explain(model, *call_args, kwargs=call_kwargs, **_options(args))
    print(explanation)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slcompile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train a small GPT a few steps next to eager")
    demo.add_argument("--steps", type=int, default=3, help="training steps (default: 3)")
    demo.add_argument("--layers", type=int, default=4, help="transformer blocks (default: 4)")
    demo.add_argument("--width", type=int, default=64, help="d_model (default: 64)")
    demo.add_argument("--batch", type=int, default=8, help="batch size (default: 8)")
    demo.add_argument("--seq-len", type=int, default=32, help="tokens per sample (default: 32)")
    _add_config_flags(demo)
    demo.set_defaults(run=_demo)

    explain = commands.add_parser("explain", help="what the backend would do with a model")
    explain.add_argument("target", help="module:factory; factory() returns (model, args[, kwargs])")
    _add_config_flags(explain)
    explain.set_defaults(run=_explain)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.debug:
        return args.run(args)
    try:
        return args.run(args)
    except Exception as exc:  # one clear line; --debug for the traceback
        print(f"slcompile: error: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
