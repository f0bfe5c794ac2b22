"""A model's weights in the Hugging Face layout, written from where they rest.

`slcompile.save_pretrained(model, path, max_shard_size=...)` writes what
`model.state_dict()` holds as safetensors files (`safetensors.torch.save_file`):
`model.safetensors` when it is one file, else `model-00001-of-0000N.safetensors` and
`model.safetensors.index.json` (Hugging Face's sharded checkpoint: each name's file
under `weight_map`, the bytes of all of them as `metadata.total_size`); for a
transformers `PreTrainedModel` also its `config.json` (and `generation_config.json`
where it generates), so that `from_pretrained(path)` loads it.

Where the values come from, one file at a time: a resident parameter or buffer, or
an offloaded one inside `gathered_weights`, as it is; a block weight offloaded by a
compiled step from the host copy of the `slcompile.offload_optimizer` that steps it
(what `model.state_dict()` reads: the newest values), else loaded from its tier. A file holds the streamed weights of one
block at most (a block is a parameter's module path up to its layer index,
`model.layers.3`), so saving loads one block's weights at a time, never the whole
model, whatever `max_shard_size` is; files end at `max_shard_size` besides (a tensor
larger than it has a file of its own), so a model with streamed weights has at least
one file per block.

Tied weights (one parameter under several names) are written once, under the name
Hugging Face keeps (`remove_tied_weights_from_state_dict`; the first name of
`named_parameters()` for other models), a `PreTrainedModel`'s
`_keys_to_ignore_on_save` are left out, and weights transformers converts when it
loads them are converted back, file by file, as its `save_pretrained` does for an
offloaded model (`revert_weight_conversion`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator

import torch
from safetensors.torch import save_file

from slcompile.config import parse_bytes
from slcompile.errors import OptionError
from slcompile.optim import OffloadedOptimizer
from slcompile.runtime.gradients import consumer_of
from slcompile.runtime.weights import load_whole, shard_group_of, weight_home

__all__ = ["save_pretrained", "SAFE_WEIGHTS_NAME", "SAFE_WEIGHTS_INDEX_NAME"]

log = logging.getLogger(__name__)

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def save_pretrained(model: torch.nn.Module, path: str | os.PathLike, max_shard_size: int | str = "50GB") -> None:
    """Writes `model`'s state to the directory `path` in the Hugging Face safetensors
    layout (see the module docstring), its offloaded weights one block at a time.

    Weight files of that layout already in `path` that this save does not write are
    removed once the new ones are written, so `from_pretrained` reads only these.

    Args:
        model: the model (compiled in place, or wrapped by `torch.compile`).
        path: the directory (made if missing).
        max_shard_size: the most bytes of one file, an int or a size like "5GB" or
            "512MiB" (Hugging Face's default, "50GB").

    Raises:
        ValueError: `max_shard_size` is not a size; weights are sharded across ranks
            (`shard_weights`: save them with `slcompile.save_sharded`).
    """
    model = getattr(model, "_orig_mod", model)
    try:
        limit = parse_bytes(max_shard_size, "max_shard_size")
    except OptionError:
        raise ValueError(f"save_pretrained: max_shard_size must be bytes or a size like '5GB' or '512MiB', "
                         f"got {max_shard_size!r}") from None
    entries = _entries(model)
    sharded = [name for name, tensor in entries if shard_group_of(tensor) is not None]
    if sharded:
        raise ValueError(f"save_pretrained: {sharded[0]!r} (and {len(sharded) - 1} more) is sharded across ranks "
                         "(shard_weights=True), each rank holding a part: save with slcompile.save_sharded")
    files = _plan_files(entries, limit)
    os.makedirs(path, exist_ok=True)
    names = ([SAFE_WEIGHTS_NAME] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    convert = _checkpoint_format(model)
    weight_map: dict[str, str] = {}
    total = 0
    for file_name, members in zip(names, files):
        values = convert(dict(_values(members)))
        save_file({name: value.contiguous() for name, value in values.items()}, os.path.join(path, file_name),
                  metadata={"format": "pt"})
        weight_map.update((name, file_name) for name in values)
        total += sum(_nbytes(value) for value in values.values())
        del values  # the loaded block goes before the next one is loaded
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(path, SAFE_WEIGHTS_INDEX_NAME), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    _remove_stale(path, set(names) | ({SAFE_WEIGHTS_INDEX_NAME} if len(files) > 1 else set()))
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(path)
        generation = getattr(model, "generation_config", None)
        can_generate = getattr(model, "can_generate", None)
        if generation is not None and callable(can_generate) and can_generate():
            generation.save_pretrained(path)
    log.info("save_pretrained: %d tensors in %d files to %s", len(entries), len(files), path)


def _entries(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter or buffer) of what `model.state_dict()` holds, in its order,
    each tied tensor once and without the names the model ignores on save; read
    without reading a value (offloaded parameters hold none)."""
    entries: list[tuple[str, torch.Tensor]] = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for name, param in module._parameters.items():
            if param is not None:
                entries.append((prefix + name, param))
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                entries.append((prefix + name, buffer))
    ignored = getattr(model, "_keys_to_ignore_on_save", None) or ()
    entries = [(name, tensor) for name, tensor in entries if name not in ignored]
    kept = _untied_names(model, entries)
    return [(name, tensor) for name, tensor in entries if name in kept]


def _untied_names(model: torch.nn.Module, entries: list[tuple[str, torch.Tensor]]) -> set[str]:
    """The names to write: one of each tensor that several names share."""
    try:
        from transformers import PreTrainedModel
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:
        PreTrainedModel = None
    if PreTrainedModel is not None and isinstance(model, PreTrainedModel):
        # Hugging Face's choice of the name to keep, made on tensors without values
        # (a meta tensor stands for its parameter, by identity).
        meta = {name: torch.empty(tensor.shape, dtype=tensor.dtype, device="meta") for name, tensor in entries}
        return set(remove_tied_weights_from_state_dict(meta, model))
    seen: set[int] = set()
    kept = set()
    for name, tensor in entries:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            kept.add(name)
    return kept


def _checkpoint_format(model: torch.nn.Module):
    """`values -> values` in the layout of the model's checkpoints: for a
    `PreTrainedModel` whose weights transformers converts when it loads them (experts
    fused into one tensor, say), Hugging Face's `revert_weight_conversion`, file by
    file as its `save_pretrained` reverts an offloaded model's; else as they are."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return lambda values: values
    if not isinstance(model, PreTrainedModel):
        return lambda values: values
    return lambda values: revert_weight_conversion(model, values)


def _block_of(name: str) -> str:
    """The block a parameter belongs to: its path up to the first layer index."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


def _released(tensor: torch.Tensor) -> bool:
    """Whether the values of `tensor` rest off the device (an offloaded parameter
    outside `gathered_weights`, which holds no memory)."""
    return weight_home(tensor) is not None and tensor.untyped_storage().nbytes() == 0


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _plan_files(entries, limit: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The entries of each file, in order: a file ends before the entry that would
    take it over `limit`, and before a streamed weight of another block than the
    streamed weights it holds."""
    files: list[list[tuple[str, torch.Tensor]]] = []
    size, block = 0, None
    for name, tensor in entries:
        streamed = _released(tensor)
        nbytes = _nbytes(tensor)
        if not files or size + nbytes > limit and size or streamed and block not in (None, _block_of(name)):
            files.append([])
            size, block = 0, None
        files[-1].append((name, tensor))
        size += nbytes
        if streamed:
            block = _block_of(name)
    return files


def _values(members) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, values on the CPU) of a file's entries."""
    for name, tensor in members:
        if not _released(tensor):
            values = tensor.detach()
        else:
            optimizer = consumer_of(tensor)
            if isinstance(optimizer, OffloadedOptimizer):
                values = optimizer.host_copy(tensor).to(dtype=tensor.dtype)
            else:
                values = load_whole(tensor).view(tensor.shape)
        yield name, values.to("cpu").contiguous()


def _remove_stale(path, written: set[str]) -> None:
    """Removes the weight files of the layout in `path` that this save did not write."""
    for entry in os.listdir(path):
        if entry not in written and (entry in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME) or _SHARD_NAME.fullmatch(entry)):
            os.remove(os.path.join(path, entry))
