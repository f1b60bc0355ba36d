"""Hugging Face's Trainer training an optimized model, as it trains the model itself."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

import offremat

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer's dependency


class Tokens(Dataset):
    """Eight rows of 16 token ids, the labels the ids themselves (a language model)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


def _train(model: torch.nn.Module, folder: Path, bf16: bool, smoothing: float = 0.0) -> list[float]:
    arguments = transformers.TrainingArguments(
        bf16=bf16,
        label_smoothing_factor=smoothing,
        output_dir=str(folder),
        per_device_train_batch_size=4,
        num_train_epochs=1,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=Tokens())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize(("bf16", "smoothing"), [(False, 0.0), (True, 0.0), (False, 0.1)])
def test_trainer_trains_optimized_model_as_the_model(
    tmp_path: Path, bf16: bool, smoothing: float
) -> None:
    """With label smoothing the Trainer shifts a causal LM's labels, which it tells by the
    model's name (``_get_name``): "OptimizedModule" trained on unshifted labels, its losses
    4.159 where the model's were 3.941 (review 40)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=50,
    )
    model = transformers.LlamaForCausalLM(config)
    plain = copy.deepcopy(model)
    ids = torch.stack([Tokens()[k]["input_ids"] for k in range(4)])
    # The Trainer's bf16 runs the step under autocast, which the plan must be made under.
    autocast = torch.bfloat16 if bf16 else None
    batch = {"input_ids": ids, "labels": ids}
    optimized = offremat.optimize(model, batch, budget=0.8, autocast=autocast)
    assert "recompute" in optimized.plan.decisions.values()
    # The Trainer keeps the dataset columns the forward's signature names: (*args, **kwargs)
    # left every batch empty ("The batch received was empty").
    assert inspect.signature(optimized.forward) == inspect.signature(model.forward)
    losses = _train(optimized, tmp_path / "optimized", bf16, smoothing)
    assert losses == _train(plain, tmp_path / "plain", bf16, smoothing)
    pairs = zip(model.parameters(), plain.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_accelerate_wraps_and_unwraps_the_optimized_forward() -> None:
    """accelerate's mixed precision takes the forward apart (``__func__``) and binds it
    again; unwrapping it (``keep_fp32_wrapper=False``) bound the optimized model twice."""
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(6)]
    model = torch.nn.Sequential(*layers)
    plain = copy.deepcopy(model)
    x = torch.randn(32, 16)
    optimized = offremat.optimize(model, x, budget=0.8, autocast=torch.bfloat16)
    assert "recompute" in optimized.plan.decisions.values()
    # accelerate keeps its state per process: a Trainer run before without bf16 set it.
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = accelerate.Accelerator(mixed_precision="bf16", cpu=True)
    prepared = accelerator.prepare(optimized)
    unwrapped = accelerator.unwrap_model(prepared, keep_fp32_wrapper=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = plain(x).float().pow(2).mean()
    for run in (prepared, unwrapped):
        loss = run(x).float().pow(2).mean()
        loss.backward()
        assert torch.equal(loss, expected)
