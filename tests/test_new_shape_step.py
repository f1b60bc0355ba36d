"""The step that plans a new input shape keeps its budget too, its profile included.

A new shape is profiled in its own step. The profile of the code around a model's blocks ran
a step of that code with gradients made for its parameters, beside the caller's gradients
(set aside, still allocated): a Llama whose head and embedding hold most of its parameters
measured 1.03 times its budget in the step that planned a shorter sequence, and 0.63 in the
next. The profile of each stage gave its parameters gradients of its own beside the caller's
too: a Llama with a wide MLP (a layer's parameters 0.6 of the budget) measured 1.18 times
its budget in that step (a hunt). Oracles: the step's memory measured independently
(``StepMemory``, gradients allocated before, as after a first step) and plain autograd's
gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch

import offremat
from offremat.measure import StepMemory
from tests import model_zoo as zoo


def batch(length: int, seed: int, vocab: int = 2048) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, vocab, (2, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


CASES = {
    "untied": ({"vocab_size": 2048}, 0.95),
    "tied": ({"vocab_size": 2048, "tie_word_embeddings": True}, 0.95),
    "wide MLP": ({"vocab_size": 96, "intermediate_size": 1024, "num_hidden_layers": 4}, 0.5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_step_that_plans_a_new_length_fits_the_budget(case: str) -> None:
    settings, fraction = CASES[case]
    vocab = settings["vocab_size"]
    torch.manual_seed(0)
    model = zoo.llama(**settings).train()
    reference = copy.deepcopy(model)
    optimized = offremat.optimize(model, batch(16, 0, vocab), budget=fraction)
    budget = optimized.plan.budget_bytes
    for length, seed in ((16, 1), (12, 2), (12, 3)):  # 12 is planned in its first step
        for parameter in (*model.parameters(), *reference.parameters()):
            parameter.grad = torch.zeros_like(parameter)
        step = batch(length, seed, vocab)
        with StepMemory("cpu", inputs=step) as memory:
            optimized(**step).loss.backward()
        reference(**step).loss.backward()
        assert memory.peak_bytes <= budget, f"length {length}: {memory.peak_bytes} B of {budget}"
        pairs = zip(model.parameters(), reference.parameters(), strict=True)
        assert all(torch.equal(p.grad, q.grad) for p, q in pairs)
    assert optimized.cache_info()["misses"] == 1
