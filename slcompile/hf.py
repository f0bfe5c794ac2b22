"""The Hugging Face `Trainer` on the speedloader backend.

`SpeedLoaderTrainer` is `transformers.Trainer` with the model compiled by the
speedloader backend: replace `Trainer(...)` with `SpeedLoaderTrainer(...,
speedloader=slcompile.options(num_subbatches=4, weights="nvme"))` (or leave
`speedloader` out and set the options with `slcompile.defaults` or `SLC_*`
environment variables). Everything else is the Trainer's own: its data loading,
loop, LR scheduler, evaluation, logging, checkpoints and resume.

What the subclass changes, and why:

1. The model is compiled in place (`model.compile(backend="speedloader",
   options=...)`), not wrapped by accelerate: accelerate accepts only the backends
   of its `DynamoBackend` enum, and an in-place compile keeps the model's class,
   forward signature (the Trainer drops the dataset columns the forward does not
   take) and state-dict keys. Training runs the training graph, evaluation
   (eval mode, no grad) an inference graph of the same backend.
2. With the block weights off the device (`weights="nvme"`, or `"host"` on a GPU
   machine) the optimizer is `slcompile.offload_optimizer` over the Trainer's own
   choice: the optimizer class and options from `TrainingArguments.optim` (or
   `optimizer_cls_and_kwargs`), its weight-decay groups, and `max_grad_norm`,
   which the offloaded optimizer clips in two phases (the Trainer's
   `clip_grad_norm_` would not see the streamed weights' gradients, which never
   become `.grad`); the logged `grad_norm` is the optimizer's `last_grad_norm`.
   The Trainer's LR scheduler sets the learning rate in its param groups, which
   every block step reads. Weights resident on the device keep the Trainer's own
   optimizer and clipping.
3. `gradient_accumulation_steps > 1` with streamed weights compiles with
   `gradients="device"`: the offloaded optimizer steps each block as its
   gradients arrive, once per backward, so gradients that add up over several
   backward calls come back as `.grad` (device memory for every streamed
   gradient) and the optimizer steps them from there. `num_subbatches` splits a
   batch without that cost.
4. Checkpoints: with streamed weights the model's files (a peft model's adapters
   excepted, which peft saves) are written by
   `slcompile.save_pretrained` (`_save`): the Hugging Face safetensors layout, its
   streamed weights read one block at a time from the offloaded optimizer's host
   copies (or their tier), never the whole model at once as `model.state_dict()`
   would; a model with streamed weights has at least one file per block, so the
   Trainer's checkpoint is sharded (`model.safetensors.index.json`), which its
   resume reads as any sharded checkpoint. `load_state_dict()` writes streamed
   weights through the host copies, and the optimizer's `state_dict()` is keyed by
   parameter name, so a checkpoint resumes in a fresh `SpeedLoaderTrainer` and model.

A batch that K does not divide (a last batch of 3 at K=2, say) runs the plain graph
(the backend's fallback); with streamed weights that step runs inside
`gathered_weights`, since the plain graph reads every weight where it lives.

Refused with a `ValueError` naming it: `model_init` (hyperparameter search), and
with streamed weights an optimizer passed in `optimizers=` that is not an
`OffloadedOptimizer` (it would read the released parameters) or an `optim` whose
optimizer is a factory. DeepSpeed and FSDP wrap the model themselves; they are
not meant to run with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME

from slcompile import defaults
from slcompile.config import SpeedLoaderConfig, batch_split_problem, check_names, options_of_mode
from slcompile.facts import machine_facts
from slcompile.optim import OffloadedOptimizer, offload_optimizer
from slcompile.pretrained import save_pretrained
from slcompile.runtime.gathering import gathered_weights, offloaded_parameters

__all__ = ["SpeedLoaderTrainer"]

log = logging.getLogger(__name__)


class SpeedLoaderTrainer(Trainer):
    """`transformers.Trainer` with the model compiled by the speedloader backend.

    Args:
        *args: `Trainer`'s arguments.
        speedloader: the backend's options (`slcompile.options(...)`); those not
            given come from `slcompile.defaults` (and its `SLC_*` environment
            variables) as they are when the trainer is made.
        offloaded_optimizer: options of `slcompile.offload_optimizer` besides the
            optimizer class and its hyperparameters (`states`, `gradients`; both
            "host" by default); used when the block weights are off the device.
        **kwargs: `Trainer`'s keyword arguments.

    Raises:
        ValueError: a bad speedloader option, `model_init`, `torch_compile` with
            another backend or a mode other than "default" and "reduce-overhead"
            (which sets the `cudagraphs` option unless `speedloader` names it),
            with streamed weights an optimizer that is not offloaded, or an
            offloaded optimizer whose `max_grad_norm` is not the arguments'.
    """

    def __init__(self, *args: Any, speedloader: Mapping[str, Any] | None = None,
                 offloaded_optimizer: Mapping[str, Any] | None = None, **kwargs: Any):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None and training_args.torch_compile:
            if training_args.torch_compile_backend != "speedloader":
                raise ValueError(
                    f"SpeedLoaderTrainer compiles the model with the speedloader backend itself; "
                    f"TrainingArguments(torch_compile_backend={training_args.torch_compile_backend!r}) would "
                    "compile it a second time: leave torch_compile off"
                )
            if training_args.torch_compile_mode is not None:
                # The mode's options, under those given by name.
                speedloader = {**options_of_mode(training_args.torch_compile_mode, instead=(
                    f"TrainingArguments(torch_compile_mode={training_args.torch_compile_mode!r}); pass "
                    "SpeedLoaderTrainer(speedloader=slcompile.options(...)) or set slcompile.defaults")),
                    **(speedloader or {})}
            # accelerate's DynamoBackend has no "speedloader": the compile is ours.
            training_args.torch_compile = False
            training_args.torch_compile_backend = None
        # The defaults as they are now: the optimizer chosen here and the graphs
        # compiled later see the same options.
        values, sources = defaults.resolve(check_names(dict(speedloader or {})))
        options = {name: values[name] for name in sources}
        config = SpeedLoaderConfig.from_options(options)  # checked before the Trainer starts
        super().__init__(*args, **kwargs)
        if self.model_init is not None:
            raise ValueError("SpeedLoaderTrainer takes a model, not model_init: the model is compiled once, "
                             "when the trainer is made")
        self.streams_weights = config.shard_weights or machine_facts(config.offload_dir).copies(config.weights)
        self.offloaded_optimizer_options = dict(offloaded_optimizer or {})
        if self.streams_weights and self.optimizer is not None and not isinstance(self.optimizer, OffloadedOptimizer):
            raise ValueError(
                f"speedloader weights={config.weights!r} releases the block weights between uses, which "
                f"{type(self.optimizer).__name__} would read: pass no optimizer (the trainer makes "
                "slcompile.offload_optimizer from TrainingArguments.optim) or an slcompile.offload_optimizer"
            )
        clip = self.args.max_grad_norm if self.args.max_grad_norm and self.args.max_grad_norm > 0 else None
        if isinstance(self.optimizer, OffloadedOptimizer) and self.optimizer.max_grad_norm != clip:
            raise ValueError(
                f"TrainingArguments(max_grad_norm={self.args.max_grad_norm}) is the offloaded optimizer's to clip "
                f"(the Trainer's clip_grad_norm_ would not see the streamed gradients), but it was made with "
                f"max_grad_norm={self.optimizer.max_grad_norm}: make it with "
                f"slcompile.offload_optimizer(..., max_grad_norm={clip})"
            )
        if self.streams_weights and self.args.gradient_accumulation_steps > 1:
            if options.get("gradients", config.gradients) not in ("auto", "device"):
                raise ValueError(
                    f"gradient_accumulation_steps={self.args.gradient_accumulation_steps} adds gradients up over "
                    f"several backward calls, but speedloader gradients={options['gradients']!r} hands each "
                    "backward's to the offloaded optimizer: use gradients='auto' (or 'device'), or one "
                    "accumulation step with a larger batch split by num_subbatches"
                )
            options["gradients"] = "device"
        self.speedloader_options = options
        self.batch_dim = config.batch_dim
        self.num_subbatches = config.num_subbatches
        self.model.compile(backend="speedloader", options=options)

    def _prepare_input(self, data):
        """Each batch size gets a graph of its own (the last, smaller batch and the
        evaluation batch too): a batch dimension Dynamo made dynamic would not be
        split into sub-batches. Other dimensions (padded lengths) may be dynamic."""
        data = super()._prepare_input(data)
        if isinstance(data, torch.Tensor) and data.dim() > self.batch_dim:
            torch._dynamo.mark_static(data, self.batch_dim)
        return data

    def training_step(self, model, inputs, *args: Any, **kwargs: Any):
        with self._weights_for(inputs):
            return super().training_step(model, inputs, *args, **kwargs)

    def prediction_step(self, model, inputs, *args: Any, **kwargs: Any):
        with self._weights_for(inputs):
            return super().prediction_step(model, inputs, *args, **kwargs)

    def _weights_for(self, inputs):
        """A batch that K does not divide (the last one, say) runs the plain graph,
        which reads every weight where it lives: with streamed weights, that step
        runs inside `gathered_weights` (the whole model on the device for it)."""
        batch = next((value.shape[self.batch_dim] for value in inputs.values()
                      if isinstance(value, torch.Tensor) and value.dim() > self.batch_dim), None)
        problem = None if batch is None else batch_split_problem(batch, self.num_subbatches)
        if not self.streams_weights or problem is None:
            return contextlib.nullcontext()
        log.info("speedloader: %s: this step gathers the streamed weights", problem)
        return gathered_weights(self.model)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The model's files, its config, the processing class and the arguments, as
        the Trainer's `_save` writes them; with streamed weights (and no
        `state_dict` given) the weights through `slcompile.save_pretrained`, one
        block at a time from where they rest. A peft model saves its adapters as peft
        does (the Trainer's own `_save`)."""
        if state_dict is not None or not offloaded_parameters(self.model) or _is_peft_model(self.model):
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return None
        log.info("speedloader: saving the model's weights block by block to %s", output_dir)
        save_pretrained(self.model, output_dir)
        tokenizer = getattr(self.data_collator, "tokenizer", None)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        return None

    @property
    def _offloads_optimizer(self) -> bool:
        return isinstance(_unwrap_optimizer(self.optimizer), OffloadedOptimizer)

    def create_optimizer(self, model=None):
        """`slcompile.offload_optimizer` over the Trainer's optimizer class, options and
        param groups when the block weights stream; else the Trainer's own."""
        if self.optimizer is not None or not self.streams_weights:
            return super().create_optimizer(model)
        opt_model = self.model if model is None else model
        decay = self.get_decay_parameter_names(opt_model)
        trained = [(name, param) for name, param in opt_model.named_parameters() if param.requires_grad]
        groups = [
            {"params": [p for n, p in trained if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in trained if n not in decay], "weight_decay": 0.0},
        ]
        if self.optimizer_cls_and_kwargs is not None:
            optimizer_class, optimizer_options = self.optimizer_cls_and_kwargs
        else:
            optimizer_class, optimizer_options = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        unusable = {"params", "model", "optimizer_dict"} & set(optimizer_options)
        if not isinstance(optimizer_class, type) or unusable:
            raise ValueError(
                f"SpeedLoaderTrainer with streamed weights steps a torch.optim.Optimizer class block by block; "
                f"optim={self.args.optim!r} gives {optimizer_class!r}"
                + (f" with its own {', '.join(sorted(unusable))}" if unusable else "")
            )
        max_grad_norm = self.args.max_grad_norm if self.args.max_grad_norm and self.args.max_grad_norm > 0 else None
        self.optimizer = offload_optimizer(opt_model, optimizer_class, params=groups, max_grad_norm=max_grad_norm,
                                           **self.offloaded_optimizer_options, **optimizer_options)
        return self.optimizer

    def _clip_grad_norm(self, model):
        if self._offloads_optimizer:
            return None  # the offloaded optimizer clips in its step (max_grad_norm)
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if self._offloads_optimizer:
            return None  # known after the step: `log` takes the optimizer's last_grad_norm
        return super()._get_grad_norm(model, grad_norm)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        optimizer = _unwrap_optimizer(self.optimizer)
        if isinstance(optimizer, OffloadedOptimizer) and "loss" in logs and "grad_norm" not in logs \
                and optimizer.last_grad_norm is not None:
            logs = {**logs, "grad_norm": optimizer.last_grad_norm.item()}
        super().log(logs, *args, **kwargs)


def _is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _unwrap_optimizer(optimizer):
    """The optimizer inside accelerate's `AcceleratedOptimizer`."""
    return getattr(optimizer, "optimizer", optimizer)

