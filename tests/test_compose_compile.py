"""Compiled blocks under offremat: no recompiles of its code, gradients of plain autograd.

The blocks are compiled with a counting AOT-autograd backend (no inductor, so the test is
quick): the count shows that the compiled code itself runs in every step, and the graphs it
saves tensors from are those of AOT autograd, as with inductor.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd

import offremat
from offremat.models import GPTConfig, build_gpt, gpt_batch


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _MLP(nn.Module):
    """Six blocks in a ModuleList, looped over in forward: found by watching one call."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(6))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


class _Recompiles(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def recompiles() -> Iterator[_Recompiles]:
    torch._dynamo.reset()
    handler = _Recompiles()
    torch._logging.set_logs(recompiles=True)
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
        torch._dynamo.reset()


def _counting_backend() -> tuple[object, list[int]]:
    runs: list[int] = []

    def compiler(graph: torch.fx.GraphModule, _: object) -> object:
        def run(args: list[object]) -> object:
            runs.append(1)
            return graph(*args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler), runs


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(("kind", "budget"), [("mlp", 0.4), ("gpt", 0.5)])
def test_compiled_blocks_no_recompiles_and_equal_gradients(
    recompiles: _Recompiles, kind: str, budget: float
) -> None:
    backend, runs = _counting_backend()

    def build() -> tuple[nn.Module, list[nn.Module], list[object]]:
        if kind == "mlp":
            torch.manual_seed(0)
            model = _MLP()
            seeds = [torch.Generator().manual_seed(s) for s in range(3)]
            batches = [torch.randn(64, 32, generator=g) for g in seeds]
            return model, list(model.blocks), batches
        config = GPTConfig(layers=4, hidden=32, heads=2, seq=16, vocab=64, dropout=0.0)
        model = build_gpt(config)
        blocks = [m for n, m in model.named_children() if n.startswith("block")]
        return model, blocks, [gpt_batch(config, 4, seed=s) for s in range(3)]

    plain, plain_blocks, batches = build()
    ours, our_blocks, _ = build()
    for block in (*plain_blocks, *our_blocks):
        block.compile(backend=backend)
    om = offremat.optimize(ours, batches[0], budget=budget)
    assert "recompute" in om.plan.decisions.values()
    for step, batch in enumerate(batches):
        if step == 1:
            recompiles.messages.clear()
            runs.clear()
        plain(batch).backward()
        om(batch).backward()
        for a, b in zip(_grads(ours), _grads(plain), strict=True):
            assert torch.equal(a, b)
    assert recompiles.messages == [], "\n".join(recompiles.messages)
    assert runs, "the compiled code did not run after the first step"


def test_torch_compile_of_the_optimized_model_says_to_compile_the_blocks() -> None:
    config = GPTConfig(layers=2, hidden=32, heads=2, seq=16, vocab=64, dropout=0.0)
    model = build_gpt(config)
    batch = gpt_batch(config, 2)
    om = offremat.optimize(model, batch, budget=1.0)
    compiled = torch.compile(om, backend="eager")
    try:
        with pytest.raises(RuntimeError, match=r"block\.compile\(\)"):
            compiled(batch)
        om.eval()
        with torch.no_grad():
            assert torch.equal(compiled(batch), model(batch))
    finally:
        torch._dynamo.reset()


def test_a_compiled_model_given_to_optimize_is_refused_saying_to_compile_the_blocks() -> None:
    # Its steps call the blocks themselves: the whole-model graph would never run.
    config = GPTConfig(layers=2, hidden=32, heads=2, seq=16, vocab=64, dropout=0.0)
    model = build_gpt(config)
    with pytest.raises(TypeError, match=r"block\.compile\(\)"):
        offremat.optimize(torch.compile(model, backend="eager"), gpt_batch(config, 2), budget=1.0)
    model.compile(backend="eager")  # in place: the module's own call compiled
    try:
        with pytest.raises(TypeError, match=r"block\.compile\(\)"):
            offremat.optimize(model, gpt_batch(config, 2), budget=1.0)
    finally:
        torch._dynamo.reset()


class _DropoutBlock(_Block):
    def __init__(self, width: int):
        super().__init__(width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(x))))


def test_blocks_compiled_by_inductor_draw_their_dropout_masks_as_the_model_does() -> None:
    """Inductor draws dropout masks otherwise than eager code: a recomputed stage's first
    forward run eagerly (to watch it) drew other masks, and the generator's stream differed
    at every later step."""
    torch._dynamo.reset()

    def build() -> _MLP:
        torch.manual_seed(0)
        model = _MLP()
        model.blocks = nn.ModuleList(_DropoutBlock(32) for _ in range(3))
        for block in model.blocks:
            block.compile()
        return model

    plain, ours = build(), build()
    batches = [torch.randn(64, 32, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    om = offremat.optimize(ours, batches[0], budget=0.6)
    assert "recompute" in om.plan.decisions.values()
    torch.manual_seed(1)  # once: the generator's stream must stay the model's
    for batch in batches:
        state = torch.get_rng_state()
        expected = plain(batch)
        expected.backward()
        after = torch.get_rng_state()
        torch.set_rng_state(state)
        got = om(batch)
        got.backward()
        assert torch.equal(got, expected)
        assert torch.equal(torch.get_rng_state(), after)
        for a, b in zip(_grads(ours), _grads(plain), strict=True):
            assert torch.equal(a, b)
        for model in (plain, ours):
            model.zero_grad()
    torch._dynamo.reset()
