"""Lightning's Trainer on a speedloader-compiled model with its block weights on nvme
and `slcompile.offload_optimizer` from `configure_optimizers`: automatic optimization
hands `OffloadedOptimizer.step` a closure (forward and backward), and the losses and
trained weights equal the same Trainer's run of the eager model with
`torch.optim.AdamW`. Clipping goes through `max_grad_norm`; `gradient_clip_val`,
which would clip only the resident parameters' `.grad`, is refused."""

from __future__ import annotations

import copy

import pytest
import torch

import slcompile
from models import GPTConfig, TinyGPT, make_gpt_batch

lightning = pytest.importorskip("lightning")

CFG = GPTConfig(n_layers=2, d_model=32, vocab_size=64, seq_len=8)
LR = 1e-2


class _Module(lightning.LightningModule):
    """Trains `model` (`forward(idx, targets) -> (logits, loss)`) with the optimizer
    `make_optimizer(model)` returns, keeping each step's loss."""

    def __init__(self, model, make_optimizer):
        super().__init__()
        self.model = model
        self.make_optimizer = make_optimizer
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(*batch)[1]
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return self.make_optimizer(self.model)


def _fit(model, make_optimizer, **trainer_options) -> _Module:
    batches = [make_gpt_batch(CFG, 4, seed=step) for step in range(3)]
    module = _Module(model, make_optimizer)
    trainer = lightning.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, **trainer_options)
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    return module


def _compiled(offload_dir) -> tuple[TinyGPT, TinyGPT]:
    """A TinyGPT compiled in place with its block weights on nvme, and an eager copy."""
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    # The key part of a fused qkv bias has an exactly-zero gradient in exact arithmetic
    # (softmax ignores it): both runs see only rounding noise there, which AdamW scales
    # up to steps of size lr that differ between them.
    for block in model.layers:
        block.attn.qkv.register_parameter("bias", None)
    eager = copy.deepcopy(model)
    model.compile(backend="speedloader", options=slcompile.options(
        num_subbatches=2, weights="nvme", offload_dir=str(offload_dir), lowering="aot_eager"))
    return model, eager


def test_trainer_fit_with_the_offloaded_optimizer_matches_eager_adamw_clipping_by_max_grad_norm(tmp_path):
    model, eager = _compiled(tmp_path)
    module = _fit(model, lambda m: slcompile.offload_optimizer(m, torch.optim.AdamW, lr=LR, states="nvme",
                                                               gradients="nvme", max_grad_norm=0.05))
    expected = _fit(eager, lambda m: torch.optim.AdamW(m.parameters(), lr=LR), gradient_clip_val=0.05)
    assert len(module.losses) == len(expected.losses) == 3
    assert module.trainer.optimizers[0].last_grad_norm > 0.05  # the clip scaled the gradients
    torch.testing.assert_close(module.losses, expected.losses)
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None and report.weights.streamed_bytes > 0
    assert report.offloaded_gradients.bytes == report.weights.streamed_bytes  # every block gradient left
    eager_params = dict(eager.named_parameters())
    with slcompile.gathered_weights(model):
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, eager_params[name], msg=lambda text, name=name: f"{name}: {text}")


def test_trainer_gradient_clip_val_with_the_offloaded_optimizer_is_refused_before_a_step(tmp_path):
    model, _ = _compiled(tmp_path)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"gradient_clip_val=0\.5.*max_grad_norm=0\.5"):
        _fit(model, lambda m: slcompile.offload_optimizer(m, torch.optim.AdamW, lr=LR), gradient_clip_val=0.5)
    assert slcompile.compile_reports() == []  # refused before the closure's forward
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name


def test_a_checkpoint_of_the_fit_resumes_in_a_fresh_trainer_and_model_as_if_never_stopped(tmp_path):
    """Lightning's checkpoint holds the model's `state_dict()` (streamed weights read
    through the optimizer's host copies) and the offloaded optimizer's state keyed by
    parameter name; a fresh compiled model and Trainer resumed from it take the same
    steps as the run that did not stop. The same batch every step: Lightning restarts
    a plain DataLoader from its first batch."""
    batch = make_gpt_batch(CFG, 4, seed=0)

    def fit(steps, checkpoints=None, ckpt_path=None) -> _Module:
        model, _ = _compiled(tmp_path / "offload")
        module = _Module(model, lambda m: slcompile.offload_optimizer(m, torch.optim.AdamW, lr=LR, states="nvme",
                                                                      gradients="nvme"))
        callbacks = [] if checkpoints is None else [lightning.pytorch.callbacks.ModelCheckpoint(
            dirpath=checkpoints, every_n_train_steps=1, save_top_k=-1)]
        trainer = lightning.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                                    enable_checkpointing=checkpoints is not None, callbacks=callbacks,
                                    enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, torch.utils.data.DataLoader([batch] * 4, batch_size=None), ckpt_path=ckpt_path)
        torch._dynamo.reset()
        return module

    whole = fit(4)
    first = fit(2, checkpoints=tmp_path / "checkpoints")
    resumed = fit(4, ckpt_path=tmp_path / "checkpoints" / "epoch=0-step=2.ckpt")
    # Exactly: the same arithmetic from the same state.
    torch.testing.assert_close(first.losses, whole.losses[:2], rtol=0, atol=0)
    torch.testing.assert_close(resumed.losses, whole.losses[2:], rtol=0, atol=0)
    with slcompile.gathered_weights(whole.model), slcompile.gathered_weights(resumed.model):
        for (name, expected), (_, actual) in zip(whole.model.named_parameters(), resumed.model.named_parameters()):
            assert torch.equal(actual, expected), name
