"""A LoRA fine-tune (PEFT) of a Hugging Face Llama: frozen base weights, trained adapters with
dropout, the chain found inside PEFT's wrappers. Oracles: plain autograd on a copy and the
independent memory tracker."""

from __future__ import annotations

import copy

import pytest
import torch

import offremat
from offremat.measure import StepMemory
from tests import model_zoo as zoo

peft = pytest.importorskip("peft")


@pytest.mark.parametrize("budget", [0.3, 0.5])
def test_a_lora_fine_tune_trains_exactly_within_budget(budget: float) -> None:
    torch.manual_seed(0)
    adapters = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    model = peft.get_peft_model(zoo.llama(), adapters)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 96, (4, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    om = offremat.optimize(model, batch, budget=budget)
    assert "recompute" in om.plan.decisions.values()
    trained = [p for p in (*model.parameters(), *reference.parameters()) if p.requires_grad]
    for parameter in trained:
        parameter.grad = torch.zeros_like(parameter)
    torch.manual_seed(1)  # the adapters' dropout draws the same masks in both
    with StepMemory("cpu", inputs=batch) as memory:
        loss = om(**batch).loss
        loss.backward()
    torch.manual_seed(1)
    plain = reference(**batch).loss
    plain.backward()
    assert memory.peak_bytes <= om.plan.budget_bytes
    assert torch.equal(loss, plain)
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    for p, q in pairs:  # the base weights have none, in both
        assert (p.grad is None) == (q.grad is None)
        assert p.grad is None or torch.equal(p.grad, q.grad)
