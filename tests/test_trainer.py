"""The Hugging Face Trainer on the speedloader backend (`slcompile.hf.SpeedLoaderTrainer`):
logged losses, gradient norms, evaluation and the parameters after training equal
the Trainer's eager run; a checkpoint the Trainer saves resumes in a fresh trainer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainingArguments

import slcompile
from models import hf_llama
from slcompile.hf import SpeedLoaderTrainer

SPEEDLOADER = {"num_subbatches": 2, "lowering": "aot_eager"}


def _model():
    torch.manual_seed(0)
    return hf_llama(num_hidden_layers=2, hidden_size=32, vocab_size=64)


def _data(size: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 64, (16,), generator=generator) for _ in range(size)]
    return [{"input_ids": row, "labels": row.clone()} for row in rows]


def _args(output_dir, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=str(output_dir), per_device_train_batch_size=4, per_device_eval_batch_size=4,
        learning_rate=1e-2, max_grad_norm=0.5, logging_steps=1, save_strategy="no", seed=0,
        report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
    )
    return TrainingArguments(**{**values, **overrides})


def _logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def _parameters(model) -> dict[str, torch.Tensor]:
    """Every parameter by name; `state_dict()` reads streamed weights from where they rest."""
    names = {name for name, _ in model.named_parameters()}
    return {name: value.detach().clone() for name, value in model.state_dict().items() if name in names}


def _assert_same_training(trainer, eager):
    for key in ("loss", "grad_norm", "eval_loss"):
        torch.testing.assert_close(_logged(trainer, key), _logged(eager, key), msg=key)
    expected = _parameters(eager.model)
    actual = _parameters(trainer.model)
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], msg=name)


@pytest.mark.slow
def test_trainer_matches_eager_with_weights_on_nvme(tmp_path):
    """Weights on nvme, the offloaded optimizer made from TrainingArguments (AdamW,
    its weight-decay groups, its LR schedule, max_grad_norm), two accumulation steps,
    a smaller last batch (14 = 4 + 4 + 4 + 2) and an evaluation whose last batch K
    does not divide (7 = 4 + 3: that step runs plainly, with the weights gathered)."""
    data, evaluation = _data(14), _data(7)
    overrides = dict(num_train_epochs=1, gradient_accumulation_steps=2, weight_decay=0.1)
    eager = Trainer(model=_model(), args=_args(tmp_path / "eager", **overrides),
                    train_dataset=data, eval_dataset=evaluation)
    eager.train()
    eager.evaluate()

    trainer = SpeedLoaderTrainer(model=_model(), args=_args(tmp_path / "speedloader", **overrides),
                                 train_dataset=data, eval_dataset=evaluation,
                                 speedloader={**SPEEDLOADER, "weights": "nvme"})
    trainer.train()
    trainer.evaluate()

    assert isinstance(trainer.optimizer.optimizer, slcompile.OffloadedOptimizer)
    assert slcompile.offloaded_parameters(trainer.model)
    reports = slcompile.compile_reports()
    # The training batch, the last batch of 2 and the evaluation batch, each split in two.
    assert sorted(r.batch_size for r in reports if r.fallback_reason is None) == [2, 4, 4]
    assert all(r.config.num_subbatches == 2 for r in reports)
    (refused,) = [r.fallback_reason for r in reports if r.fallback_reason is not None]
    assert refused.startswith("batch size 3 ") and "is not divisible by num_subbatches=2" in refused
    assert len(_logged(trainer, "loss")) == 2
    _assert_same_training(trainer, eager)


@pytest.mark.oldest
def test_trainer_keeps_its_optimizer_with_weights_on_the_device(tmp_path):
    data = _data(8)
    eager = Trainer(model=_model(), args=_args(tmp_path / "eager", max_steps=2), train_dataset=data, eval_dataset=data)
    eager.train()
    eager.evaluate()
    trainer = SpeedLoaderTrainer(model=_model(), args=_args(tmp_path / "speedloader", max_steps=2),
                                 train_dataset=data, eval_dataset=data, speedloader=SPEEDLOADER)
    trainer.train()
    trainer.evaluate()
    assert type(trainer.optimizer.optimizer) is torch.optim.AdamW
    assert [r.fallback_reason for r in slcompile.compile_reports()] == [None, None]
    _assert_same_training(trainer, eager)


def test_trainer_resumes_from_its_checkpoint(tmp_path):
    """The Trainer's own checkpoint (weights through the offloaded optimizer's host
    copies, its nvme states, the LR scheduler) resumes in a fresh model and trainer
    where the uninterrupted run went on."""
    data = _data(16)
    options = {**SPEEDLOADER, "weights": "nvme"}
    args = dict(max_steps=4, save_strategy="steps", save_steps=2)
    whole = SpeedLoaderTrainer(model=_model(), args=_args(tmp_path / "whole", **args), train_dataset=data,
                               speedloader=options, offloaded_optimizer={"states": "nvme"})
    whole.train()
    final = _parameters(whole.model)
    # One backward per step: the gradients go to the optimizer as they are made.
    eager = Trainer(model=_model(), args=_args(tmp_path / "eager", max_steps=4), train_dataset=data)
    eager.train()
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(_logged(whole, key), _logged(eager, key), msg=key)
    expected = _parameters(eager.model)
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], msg=name)

    torch._dynamo.reset()
    resumed = SpeedLoaderTrainer(model=_model(), args=_args(tmp_path / "resumed", **args), train_dataset=data,
                                 speedloader=options, offloaded_optimizer={"states": "nvme"})
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))

    assert resumed.state.global_step == 4
    # The log history comes back with the checkpoint; steps 3 and 4 are the resumed ones.
    torch.testing.assert_close(_logged(resumed, "loss"), _logged(whole, "loss"))
    actual = _parameters(resumed.model)
    # The weights the Trainer saved last are the final ones, from the optimizer's host
    # copies, written by slcompile.save_pretrained: a file per block at least.
    checkpoint = tmp_path / "whole" / "checkpoint-4"
    files = set(json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(files) >= 2
    saved = {name: value for file in files for name, value in load_file(checkpoint / file).items()}
    for name in final:
        torch.testing.assert_close(actual[name], final[name], msg=name)
        if name in saved:
            torch.testing.assert_close(saved[name], final[name], msg=name)
    assert saved.keys() >= {name for name in final if ".layers." in name}


def test_trainer_takes_torch_compile_backend_speedloader(tmp_path):
    """`TrainingArguments(torch_compile_backend="speedloader")`, which accelerate
    refuses, is the trainer's own compile; another backend is refused by name."""
    args = _args(tmp_path / "a", torch_compile_backend="speedloader")
    SpeedLoaderTrainer(model=_model(), args=args, train_dataset=_data(4))
    assert not args.torch_compile
    with pytest.raises(ValueError, match=r"torch_compile_backend='inductor'\) would compile it a second time"):
        SpeedLoaderTrainer(model=_model(), args=_args(tmp_path / "b", torch_compile_backend="inductor"),
                           train_dataset=_data(4))


def test_trainer_takes_the_defaults_and_refuses_an_optimizer_that_reads_streamed_weights(tmp_path):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with slcompile.defaults.patch(weights="nvme"), pytest.raises(ValueError, match="weights='nvme' .* SGD would read"):
        SpeedLoaderTrainer(model=model, args=_args(tmp_path), train_dataset=_data(4), optimizers=(optimizer, None))
    with slcompile.defaults.patch(weights="nvme", num_subbatches=4):
        trainer = SpeedLoaderTrainer(model=_model(), args=_args(tmp_path), train_dataset=_data(4))
    assert trainer.speedloader_options == {"num_subbatches": 4, "weights": "nvme"}
    assert isinstance(trainer.create_optimizer(), slcompile.OffloadedOptimizer)


def test_trainer_refuses_an_offloaded_optimizer_that_would_not_clip(tmp_path):
    model = _model()
    optimizer = slcompile.offload_optimizer(model, torch.optim.AdamW, lr=1e-2)
    with pytest.raises(ValueError, match=r"max_grad_norm=0.5\) is the offloaded optimizer's to clip"):
        SpeedLoaderTrainer(model=model, args=_args(tmp_path), train_dataset=_data(4), optimizers=(optimizer, None),
                           speedloader={**SPEEDLOADER, "weights": "nvme"})


def test_trainer_maps_reduce_overhead_to_cuda_graphs(tmp_path):
    args = _args(tmp_path, torch_compile_backend="speedloader", torch_compile_mode="reduce-overhead")
    trainer = SpeedLoaderTrainer(model=_model(), args=args, train_dataset=_data(4), speedloader=SPEEDLOADER)
    assert trainer.speedloader_options == {"lowering": "aot_eager", "cudagraphs": True}  # K=2 is the default
    args = _args(tmp_path, torch_compile_backend="speedloader", torch_compile_mode="reduce-overhead")
    trainer = SpeedLoaderTrainer(model=_model(), args=args, train_dataset=_data(4),
                                 speedloader={**SPEEDLOADER, "cudagraphs": False})
    assert not slcompile.SpeedLoaderConfig.from_options(trainer.speedloader_options).cudagraphs  # named wins


def test_trainer_refuses_a_mode(tmp_path):
    with pytest.raises(ValueError, match="not mode='max-autotune': TrainingArguments.torch_compile_mode='max-aut"):
        SpeedLoaderTrainer(model=_model(), train_dataset=_data(4),
                           args=_args(tmp_path, torch_compile_backend="speedloader", torch_compile_mode="max-autotune"))
