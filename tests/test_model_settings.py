"""What a plan was made for: a model's settings and modes. A step never runs on a plan made for
other settings (a Hugging Face model's attention implementation, which decides what attention
saves) or another mode (training with dropout off in eval mode). Oracles: the independent
memory tracker and plain autograd."""

from __future__ import annotations

import copy

import pytest
import torch

import offremat
from offremat.measure import StepMemory
from tests import model_zoo as zoo

pytest.importorskip("transformers")

IDS = torch.randint(0, 96, (4, 64), generator=torch.Generator().manual_seed(0))
BATCH = {"input_ids": IDS, "labels": IDS}


def step(om, model) -> tuple[int, torch.Tensor]:
    """One training step's measured peak (gradients pre-allocated, as after the first) and
    loss."""
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    with StepMemory("cpu", inputs=BATCH) as memory:
        loss = om(**BATCH).loss
        loss.backward()
    return memory.peak_bytes, loss.detach()


def plain_step(model) -> torch.Tensor:
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    loss = model(**BATCH).loss
    loss.backward()
    return loss.detach()


def same_gradients(model, reference) -> bool:
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    return all(torch.equal(p.grad, q.grad) for p, q in pairs)


def _eager_attention(model) -> None:
    model.set_attn_implementation("eager")


def _checkpointing_on(model) -> None:
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def _checkpointing_off(model) -> None:
    model.activation_checkpointing_disable()


@pytest.mark.parametrize(
    ("before", "switch", "budget"),
    [
        # Eager attention saves its probabilities, which sdpa does not: the sdpa plan
        # measured 19% over its budget on eager attention.
        (None, _eager_attention, 0.5),
        # activation_checkpointing_disable() (gradient_checkpointing_disable() before
        # transformers 6) clears each layer's gradient_checkpointing flag and nothing else
        # (enabling also hooks the input embeddings): the plan made with it on measured 2.6
        # times its budget with it off.
        (_checkpointing_on, _checkpointing_off, 0.9),
    ],
    ids=["attention implementation", "activation checkpointing off"],
)
def test_a_setting_changed_after_optimize_is_planned_again(before, switch, budget) -> None:
    torch.manual_seed(0)
    model = zoo.llama().train()
    assert model.config._attn_implementation == "sdpa"
    if before is not None:
        before(model)
    om = offremat.optimize(model, BATCH, budget=budget)
    switch(model)
    reference = copy.deepcopy(model)
    peak, loss = step(om, model)
    assert om.cache_info()["misses"] == 1  # planned again
    assert peak <= om.plan.budget_bytes
    assert torch.equal(loss, plain_step(reference)) and same_gradients(model, reference)


def test_a_step_under_other_attention_kernels_is_refused_and_one_under_the_same_runs() -> None:
    # The math kernel saves the attention probabilities, the CPU's flash kernel does not: a
    # GPT planned on flash measured 4.3 times its budget stepped under the math kernel.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model = zoo.llama().train()
    reference = copy.deepcopy(model)
    om = offremat.optimize(model, BATCH, budget=0.5)
    with sdpa_kernel(SDPBackend.MATH), pytest.raises(RuntimeError, match="attention kernels"):
        om(**BATCH)
    with sdpa_kernel(SDPBackend.MATH):
        om = offremat.optimize(model, BATCH, budget=0.5)
        peak, loss = step(om, model)
        assert torch.equal(loss, plain_step(reference)) and same_gradients(model, reference)
    assert peak <= om.plan.budget_bytes
    with pytest.raises(RuntimeError, match="profiled with the attention kernels math allowed"):
        om(**BATCH)


class _OnesBlock(torch.nn.Module):
    """Scales by a constant made in the default dtype, which its saved tensors then take."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.ones(64)
        return x + self.outer(torch.sigmoid(torch.tanh(self.inner(x)) * scale).to(x.dtype))


def test_a_step_under_another_default_dtype_is_refused() -> None:
    # float64 set after a float32 plan: the blocks saved float64 tensors, 1.43 times the
    # budget, with no new plan and no refusal.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_OnesBlock() for _ in range(6)], torch.nn.Linear(64, 1))
    x = torch.randn(128, 64)
    om = offremat.optimize(model, x, budget=0.5)
    try:
        torch.set_default_dtype(torch.float64)
        with pytest.raises(RuntimeError, match=r"default dtype torch\.float32, but this step"):
            om(x)
    finally:
        torch.set_default_dtype(torch.float32)
    for parameter in model.parameters():  # allocated once, as after a first step
        parameter.grad = torch.zeros_like(parameter)
    with StepMemory("cpu", inputs=x) as memory:
        om(x).sum().backward()
    assert memory.peak_bytes <= om.plan.budget_bytes


def test_the_disk_cache_tells_default_dtypes_apart(tmp_path) -> None:
    # A float32 plan read from disk under float64: 1.43 times the budget, and the default
    # dtype recorded by this optimize call was float64, so the step was not refused.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_OnesBlock() for _ in range(6)], torch.nn.Linear(64, 1))
    x = torch.randn(128, 64)
    offremat.optimize(model, x, budget=0.5, cache_dir=tmp_path)
    try:
        torch.set_default_dtype(torch.float64)
        om = offremat.optimize(model, x, budget=0.5, cache_dir=tmp_path)
        assert om.cache_info()["from_disk"] == 0
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)
        with StepMemory("cpu", inputs=x) as memory:
            om(x).sum().backward()
    finally:
        torch.set_default_dtype(torch.float32)
    assert memory.peak_bytes <= om.plan.budget_bytes


@pytest.mark.parametrize("vocab", [160, 2048])
def test_code_around_the_blocks_changed_after_optimize_is_planned_again(vocab: int) -> None:
    # Embeddings resized for new tokens make larger logits outside the blocks: the old plan
    # ran on at 2.42x its budget (2048 tokens), with no new plan and no refusal.
    from solvers.budget import InfeasibleBudgetError

    torch.manual_seed(0)
    model = zoo.llama().train()
    om = offremat.optimize(model, BATCH, budget=0.5)
    for parameter in model.parameters():
        parameter.grad = None
    torch.manual_seed(1)
    model.resize_token_embeddings(vocab, mean_resizing=False)
    reference = copy.deepcopy(model)
    if vocab == 2048:
        with pytest.raises(InfeasibleBudgetError, match="least feasible budget"):
            step(om, model)
        return
    peak, loss = step(om, model)
    assert om.cache_info()["misses"] == 1  # planned again
    assert peak <= om.plan.budget_bytes
    assert torch.equal(loss, plain_step(reference)) and same_gradients(model, reference)


def test_the_disk_cache_tells_attention_implementations_apart(tmp_path) -> None:
    # Read back from the disk, the sdpa plan measured 19% over its budget on eager attention.
    for implementation in ("sdpa", "eager"):
        torch.manual_seed(0)
        model = zoo.llama(attn_implementation=implementation).train()
        om = offremat.optimize(model, BATCH, budget=0.3, cache_dir=tmp_path)
        assert om.cache_info()["from_disk"] == 0, implementation
        peak, _ = step(om, model)
        assert peak <= om.plan.budget_bytes, implementation


def test_training_in_eval_mode_follows_a_plan_of_its_own() -> None:
    # Dropout off by eval() is still training: it ran plain autograd at 3.2x the budget.
    torch.manual_seed(0)
    model = zoo.llama().train()
    model.config.attention_dropout = 0.1  # so that the modes compute differently
    om = offremat.optimize(model, BATCH, budget=0.3)
    reference = copy.deepcopy(model)
    for mode in ("eval", "train", "eval"):
        om.train(mode == "train")
        reference.train(mode == "train")
        torch.manual_seed(1)
        peak, loss = step(om, model)
        torch.manual_seed(1)
        assert torch.equal(loss, plain_step(reference)) and same_gradients(model, reference)
        assert peak <= om.plan.budget_bytes, mode
    # Each mode keeps its plans: eval was planned once, train's plan came back.
    assert om.cache_info()["misses"] == 1


def test_host_memory_of_every_mode_is_given_back() -> None:
    torch.manual_seed(0)
    model = zoo.llama().train()
    om = offremat.optimize(model, BATCH, budget=0.5, solver="offload-all", bandwidth="10GB/s")
    for mode in ("train", "eval"):
        om.train(mode == "train")
        step(om, model)
    # Both modes' executors carve their copies from one arena, given back at once.
    assert om.cache_info()["plans"] == 1 and len(om._plans.by_state) == 1
    assert om._executor.host_buffer_bytes > 0
    om.release_host_memory()
    assert om._executor.host_buffer_bytes == 0


def test_a_discriminator_frozen_at_every_other_step_keeps_both_plans() -> None:
    """A GAN's discriminator is frozen for the generator's step and trained for its own: both
    states keep their plans, so neither is profiled again, and both train as plain autograd."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(4)]
    discriminator = torch.nn.Sequential(torch.nn.Linear(32, 64), *blocks, torch.nn.Linear(64, 1))
    reference = copy.deepcopy(discriminator)
    fake = torch.randn(128, 32)
    om = offremat.optimize(discriminator, fake, budget=0.8)
    for _ in range(3):
        for frozen in (True, False):
            for model in (discriminator, reference):
                model.requires_grad_(not frozen)
                model.zero_grad()
            inputs = [fake.clone().requires_grad_(frozen) for _ in range(2)]
            om(inputs[0]).sum().backward()
            reference(inputs[1]).sum().backward()
            if frozen:
                assert torch.equal(inputs[0].grad, inputs[1].grad)
            for p, q in zip(discriminator.parameters(), reference.parameters(), strict=True):
                assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
    # One plan made after optimize's: the frozen state's (trained, the batch is the example's).
    assert om.cache_info()["misses"] == 1


def test_the_plans_of_the_last_eight_other_states_stay() -> None:
    from offremat._state_plans import KEPT_STATES

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.1), torch.nn.Tanh())
            for _ in range(10)
        ]
    )
    x = torch.randn(64, 16)
    om = offremat.optimize(model, x, budget=0.8)

    def step_in_state(k: int) -> None:  # state 0: all in training; k: dropout k - 1 in eval
        model.train()
        if k:
            model[k - 1][1].eval()
        om(x).sum().backward()

    for k in range(1, KEPT_STATES + 1):
        step_in_state(k)
    assert om.cache_info()["misses"] == KEPT_STATES
    step_in_state(0)  # one of the 8 others: its plan stayed
    assert om.cache_info()["misses"] == KEPT_STATES


def test_a_dropout_rate_changed_after_optimize_is_planned_again() -> None:
    """A dropout schedule: raised from 0 after optimize, the plan made without dropout ran at
    1.45 times its budget (the in-repo GPT: masks, and attention's math path)."""
    from offremat.models import GPTConfig, build_gpt, gpt_batch

    config = GPTConfig(layers=4, hidden=64, heads=4, seq=64, vocab=128, dropout=0.0)
    torch.manual_seed(0)
    model = build_gpt(config).train()
    batch = gpt_batch(config, 4, seed=0)
    om = offremat.optimize(model, batch, budget=0.6, solver="dp")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.1
        elif "dropout" in module.__dict__:
            module.dropout = 0.1
    reference = copy.deepcopy(model)
    for parameter in (*model.parameters(), *reference.parameters()):
        parameter.grad = torch.zeros_like(parameter)
    torch.manual_seed(1)
    with StepMemory("cpu", inputs=batch) as memory:
        loss = om(batch)
        loss.backward()
    assert om.cache_info()["misses"] == 1  # planned again
    assert memory.peak_bytes <= om.plan.budget_bytes
    torch.manual_seed(1)
    plain = reference(batch)
    plain.backward()
    assert torch.equal(loss, plain) and same_gradients(model, reference)


def test_a_feed_forward_dropout_rate_changed_after_optimize_is_planned_again() -> None:
    """BART's activation_dropout (the feed-forward's rate, a plain float in many Hugging Face
    families) raised from 0 after optimize: no plan was made again, and every step ran at
    1.23 times its budget (a hunt): only five names of rates were read."""
    pytest.importorskip("transformers")
    model = zoo.bart(encoder_ffn_dim=256, decoder_ffn_dim=256, activation_dropout=0.0)
    ids = torch.randint(3, 96, (4, 48), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.flip(1)}
    om = offremat.optimize(model, batch, budget=0.9, solver="dp")
    raised = [m for m in model.modules() if isinstance(m.__dict__.get("activation_dropout"), float)]
    assert raised
    for module in raised:
        module.activation_dropout = 0.1
    reference = copy.deepcopy(model)
    for parameter in (*model.parameters(), *reference.parameters()):
        parameter.grad = torch.zeros_like(parameter)
    torch.manual_seed(1)
    with StepMemory("cpu", inputs=batch) as memory:
        loss = om(**batch).loss
        loss.backward()
    assert om.cache_info()["misses"] == 1  # planned again
    assert memory.peak_bytes <= om.plan.budget_bytes
    torch.manual_seed(1)
    plain = reference(**batch).loss
    plain.backward()
    assert torch.equal(loss, plain) and same_gradients(model, reference)
