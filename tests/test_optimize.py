"""``offremat.optimize``: the public API of issue 4, used the way a training loop uses it."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import pkgutil
from pathlib import Path

import pytest
import torch
from torch import nn

import offremat
from offremat.models import GPTConfig, build_gpt, gpt_batch
from offremat.profiler import profile_model
from solvers.budget import InfeasibleBudgetError, parse_budget
from solvers.chain import Chain
from solvers.dp import memory_need
from solvers.plan import Plan
from solvers.registry import keep_all_peak


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks = [
        nn.Sequential(nn.Linear(12, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Dropout(0.2))
        for _ in range(5)
    ]
    return nn.Sequential(*blocks, nn.Linear(12, 3))


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # 2048 rows: activations (96 KiB) dwarf the fixed bytes of a step (RNG states, 5 KiB each).
    rows = 2048
    return torch.randn(rows, 12, generator=generator), torch.randint(
        0, 3, (rows,), generator=generator
    )


def quick_chain(model: nn.Module, x, **options):
    """A chain measured with a single run per stage, to keep the tests fast."""
    return offremat.profile_model(model, x, warmup=0, repeats=1, **options)


def train(step, model: nn.Module, steps: int = 3) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for n in range(steps):
        x, y = batch(n)
        torch.manual_seed(100 + n)
        loss = nn.functional.cross_entropy(step(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_no_export_is_hidden_by_a_submodule_of_the_same_name() -> None:
    # Importing offremat.X binds X on the package, which would replace an export called X.
    submodules = {module.name for module in pkgutil.iter_modules(offremat.__path__)}
    assert not set(offremat.__all__) & submodules
    importlib.import_module("offremat.wrapper")
    assert callable(offremat.optimize) and offremat.optimize.__name__ == "optimize"


def test_training_follows_plain_autograd_exactly() -> None:
    reference = mlp()
    expected = train(reference, reference)
    model = mlp()
    x = batch()[0]
    om = offremat.optimize(
        model, x, budget=0.5, solver="dp", chain=quick_chain(model, x), measure_memory=True
    )
    assert "recompute" in om.plan.decisions.values()
    assert train(om, om) == expected
    for mine, theirs in zip(
        model.state_dict().values(), reference.state_dict().values(), strict=True
    ):
        assert torch.equal(mine, theirs)
    stats = om.stats
    assert stats.step_time_s > 0
    assert 0 < stats.measured_peak_bytes <= om.plan.budget_bytes
    assert om.plan.predicted_time_s > 0 and om.plan.predicted_peak_bytes <= om.plan.budget_bytes


def test_the_wrapper_is_the_model_for_nn_module() -> None:
    model = mlp()
    x = batch()[0]
    om = offremat.optimize(model, x, budget=1.0, solver="keep-all", chain=quick_chain(model, x))
    assert list(om.state_dict()) == list(model.state_dict())
    assert [id(p) for p in om.parameters()] == [id(p) for p in model.parameters()]
    assert [name for name, _ in om.named_parameters()] == [n for n, _ in model.named_parameters()]
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model[0][0].weight.add_(1.0)
    om.load_state_dict(saved)
    assert torch.equal(model[0][0].weight, saved["0.0.weight"])
    om.eval()
    assert not model.training and not model[0][1].training
    om.train()
    assert model.training and model[0][1].training
    om.double()
    assert model[0][0].weight.dtype == torch.float64
    assert "keep-all" in repr(om)


def test_eval_and_no_grad_run_the_model_as_it_is() -> None:
    model = mlp()
    x = batch()[0]
    om = offremat.optimize(model, x, budget=0.5, chain=quick_chain(model, x))
    om.eval()
    assert torch.equal(om(x), model(x))
    om.train()
    with torch.no_grad():
        torch.manual_seed(0)
        expected = model(x)
        torch.manual_seed(0)
        assert torch.equal(om(x), expected)
    assert om.stats is None  # no training step has run


def test_gpt_gradients_match_with_dropout_and_tuples() -> None:
    config = GPTConfig(layers=3, hidden=32, heads=2, seq=16, vocab=64)
    inputs = gpt_batch(config, 2)
    reference = build_gpt(config)
    torch.manual_seed(5)
    reference(inputs).backward()
    model = build_gpt(config)
    chain = quick_chain(model, inputs)
    om = offremat.optimize(model, inputs, budget=0.5, solver="dp", chain=chain)
    assert "recompute" in om.plan.decisions.values()
    torch.manual_seed(5)
    om(inputs).backward()
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad)


def test_budget_forms_and_their_errors() -> None:
    model = mlp()
    x = batch()[0]
    chain = quick_chain(model, x)
    peak = keep_all_peak(chain)
    assert offremat.optimize(model, x, budget=0.6, chain=chain).plan.budget_bytes == int(0.6 * peak)
    assert offremat.optimize(model, x, budget=peak, chain=chain).plan.budget_bytes == peak
    size = f"{peak / 1024:.3f}KiB"
    expected = parse_budget(size)
    assert offremat.optimize(model, x, budget=size, chain=chain).plan.budget_bytes == expected
    with pytest.raises(InfeasibleBudgetError) as error:
        offremat.optimize(model, x, budget=64, chain=chain)
    assert error.value.min_budget_bytes > 64
    assert "least feasible budget" in str(error.value)
    with pytest.raises(ValueError, match="pass budget="):
        offremat.optimize(model, x, chain=chain)


def test_chain_and_plan_from_files(tmp_path: Path) -> None:
    model = mlp()
    x = batch()[0]
    first = offremat.optimize(model, x, budget=0.8, stages=3)
    first.chain.save(tmp_path / "chain.json")
    first.plan.save(tmp_path / "plan.json")
    again = offremat.optimize(
        model, x, chain=tmp_path / "chain.json", plan=tmp_path / "plan.json", slots=50
    )
    # The solver and its options are not used for this input, but for a new input shape: they
    # are checked now, not at the first step on another shape.
    for wrong in ({"solver": "dpp"}, {"tolerance": 0.1, "solver": "milp"}):
        with pytest.raises(ValueError, match=r"dpp|tolerance"):
            offremat.optimize(model, x, chain=first.chain, plan=first.plan, **wrong)
    assert again.plan.ops == first.plan.ops
    assert again.plan.budget_bytes == first.plan.budget_bytes
    assert again.plan.predicted_peak_bytes == first.plan.predicted_peak_bytes
    wrong = Plan(first.plan.ops, tuple(f"x{n}" for n in range(first.plan.length)), "hand")
    with pytest.raises(ValueError, match="make the plan from this chain"):
        offremat.optimize(model, x, chain=first.chain, plan=wrong)


def test_a_chain_or_plan_of_another_type_is_refused_saying_what_to_pass(tmp_path: Path) -> None:
    """A dict from json.load of a chain or plan file, or a number: a bare AttributeError
    ('dict' object has no attribute 'input_bytes') came from inside offremat before."""
    model = mlp()
    x = batch()[0]
    first = offremat.optimize(model, x, budget=0.8, stages=3)
    chain, plan = first.chain.to_dict(), first.plan.to_dict()
    with pytest.raises(TypeError, match=r"chain= takes a solvers\.chain\.Chain .* got dict.*"):
        offremat.optimize(model, x, budget=0.8, chain=chain)
    with pytest.raises(TypeError, match=r"plan= takes a solvers\.plan\.Plan .* Plan\.from_dict"):
        offremat.optimize(model, x, chain=first.chain, plan=plan)
    with pytest.raises(TypeError, match=r"plan= .* a path to a plan file .* got int 5$"):
        offremat.optimize(model, x, plan=5)
    # What the messages say to pass is taken.
    again = offremat.optimize(model, x, chain=Chain.from_dict(chain), plan=Plan.from_dict(plan))
    assert again.plan.ops == first.plan.ops


class DropoutBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.dropout = nn.Linear(64, 64), nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(torch.tanh(self.linear(x)))


@pytest.mark.parametrize("first_grads", ["allocated", "none"])
def test_a_given_chain_of_other_sizes_is_profiled_again_after_its_first_step(
    first_grads: str,
) -> None:
    """A chain profiled in eval mode (dropout saved no masks: 65536 B a stage, not 98304 B)
    was trusted: its plan measured 1.12x its budget at every step. Its first step is
    measured, as a disk cache's chain's is, and the shape profiled and planned again. A first
    step that makes the gradients (``.grad`` None) is measured without them, which the budget
    leaves out (it once passed the plan, which then ran at 1.18x its budget at every step;
    review)."""
    from offremat.measure import StepMemory

    torch.manual_seed(0)
    model = nn.Sequential(*[DropoutBlock() for _ in range(4)], nn.Linear(64, 1))
    x = torch.randn(128, 64)
    evaluated = profile_model(model.eval(), x, warmup=0, repeats=1)
    # Fixed times, so that the plan, and so its measured peak, is the same in every run.
    stages = [
        dataclasses.replace(s, fwd_s=1e-3, bwd_s=2e-3, refill_s=0.0) for s in evaluated.stages
    ]
    given = dataclasses.replace(evaluated, stages=tuple(stages))
    om = offremat.optimize(model.train(), x, chain=given, budget=0.85)
    peaks = []
    for step in range(3):
        for parameter in model.parameters():
            keep = step > 0 or first_grads == "allocated"
            parameter.grad = torch.zeros_like(parameter) if keep else None
        with StepMemory("cpu", x, gradients_of=list(model.parameters())) as memory:
            om(x).sum().backward()
        peaks.append(memory.peak_less_gradients_bytes)
    budget = om.plan.budget_bytes
    assert peaks[0] > budget  # the plan made on the given chain, in the step that checks it
    assert max(peaks[1:]) <= budget
    training = profile_model(model, x, warmup=0, repeats=1)
    sizes = [(s.saved_bytes, s.out_bytes) for s in training.stages]
    assert [(s.saved_bytes, s.out_bytes) for s in om.chain.stages] == sizes


def test_bandwidth_makes_offloading_plans_on_a_cpu() -> None:
    model = mlp()
    x = batch()[0]
    with pytest.raises(ValueError, match="link"):
        offremat.optimize(model, x, budget=1.0, solver="offload-all", chain=quick_chain(model, x))
    reference = mlp()
    expected = train(reference, reference, steps=2)
    chain = quick_chain(model, x)
    om = offremat.optimize(
        model,
        x,
        budget=1.0,
        solver="offload-all",
        bandwidth="8GB/s",
        chain=chain,
        measure_memory=True,
    )
    assert om.chain.link is not None
    assert "offload" in om.plan.decisions.values()
    assert train(om, om, steps=2) == expected
    assert om.stats.measured_peak_bytes <= om.plan.budget_bytes


def test_milp_with_a_fast_link_trains_like_plain_autograd() -> None:
    reference = mlp()
    expected = train(reference, reference, steps=2)
    model = mlp()
    x = batch()[0]
    chain = quick_chain(model, x, bandwidth=1e9)
    budget = (memory_need(chain) + keep_all_peak(chain)) // 2
    om = offremat.optimize(
        model, x, budget=budget, solver="milp", chain=chain, time_limit_s=10.0, measure_memory=True
    )
    assert train(om, om, steps=2) == expected
    assert om.stats.measured_peak_bytes <= om.plan.budget_bytes


def test_bad_input_gets_a_message_that_says_what_to_do() -> None:
    class Tree(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(offremat.NotAChainError, match=r"no run of repeated blocks in Tree.*blocks"):
        offremat.optimize(Tree(), torch.randn(2), budget=1.0)
    on_meta = nn.Sequential(nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="move the input"):
        offremat.optimize(on_meta, torch.randn(1, 2), budget=1.0)
    model = mlp()
    x = batch()[0]
    om = offremat.optimize(model, x, budget=1.0, chain=quick_chain(model, x))
    with pytest.raises(ValueError, match="parameters are on cpu"):
        om(torch.randn(16, 12, device="meta"))


def test_out_of_memory_is_reraised_with_the_plan_and_advice() -> None:
    class Exhausting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.fail = False

        def forward(self, x):
            if self.fail:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return self.linear(x)

    block = Exhausting()
    model = nn.Sequential(nn.Linear(4, 4), block)
    om = offremat.optimize(copy.deepcopy(model), torch.randn(3, 4), budget=1.0)
    om.model[1].fail = True
    with pytest.raises(torch.OutOfMemoryError) as error:
        om(torch.randn(3, 4))
    message = str(error.value)
    assert "predicted activation peak" in message and "budget" in message
    assert "profile again" in message and "Tried to allocate 2.00 GiB" in message


def test_dp_through_optimize_is_exact_unless_given_a_tolerance() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 32)) for _ in range(5)]
    )
    x = torch.randn(64, 32)
    exact = offremat.optimize(model, x, budget=0.5)
    tolerant = offremat.optimize(model, x, budget=0.5, chain=exact.chain, tolerance=0.05)
    assert "tolerance" not in exact.plan.info
    assert tolerant.plan.info["tolerance"] == 0.05
    assert tolerant.plan.predicted_time_s <= exact.plan.predicted_time_s * 1.05


def test_a_chain_or_plan_made_for_another_input_is_refused(tmp_path) -> None:
    """A chain profiled on another batch size would plan another model's memory (measured: 3
    times the budget); a plan whose simulated peak on this chain exceeds its budget too."""
    from offremat.models import GPTConfig, build_gpt, gpt_batch

    config = GPTConfig(layers=4, hidden=32, heads=2, seq=32, vocab=64, dropout=0.0)
    model = build_gpt(config, seed=0)
    small, large = gpt_batch(config, 2), gpt_batch(config, 8)
    om = offremat.optimize(model, small, budget=0.5)
    om.chain.save(tmp_path / "chain.json")
    om.plan.save(tmp_path / "plan.json")
    with pytest.raises(ValueError, match="profiled with an input of"):
        offremat.optimize(model, large, chain=tmp_path / "chain.json", budget=0.5)
    # A view of a larger tensor with the profiled shape is the same input.
    wider = tuple(torch.cat([t, t], dim=1)[:, : t.shape[1]] for t in small)
    offremat.optimize(model, wider, chain=tmp_path / "chain.json", budget=0.5)
    with pytest.raises(ValueError, match="exceeds its budget"):
        offremat.optimize(model, large, plan=tmp_path / "plan.json")


def test_a_model_moved_to_another_dtype_is_planned_again() -> None:
    from offremat.models import GPTConfig, build_gpt, gpt_batch

    config = GPTConfig(layers=4, hidden=32, heads=2, seq=32, vocab=64, dropout=0.0)
    model = build_gpt(config, seed=0)
    batch = gpt_batch(config, 4)
    om = offremat.optimize(model, batch, budget=4 * 2**20)
    before = om.chain.stages[1].out_bytes
    om.to(torch.float64)
    om(batch).backward()
    assert om.chain.stages[1].out_bytes == 2 * before  # profiled again, in float64


def test_a_model_optimized_in_eval_mode_is_planned_for_its_training_steps() -> None:
    """Hugging Face's ``from_pretrained`` returns a model in eval mode. ``optimize`` profiles it
    in training mode (dropout saves its masks there), gives every module its own flag back,
    and the training step after ``model.train()`` fits the budget and is plain autograd's."""
    config = GPTConfig(layers=4, hidden=64, heads=2, seq=64, vocab=64, dropout=0.1)
    model = build_gpt(config, seed=0)
    reference = copy.deepcopy(model)
    inputs = gpt_batch(config, 4)
    model.eval()
    model.block1.train()  # a mixed state, given back as it was
    flags = [m.training for m in model.modules()]
    om = offremat.optimize(model, inputs, budget=0.4, measure_memory=True)
    assert [m.training for m in model.modules()] == flags
    model.train()
    for parameter in model.parameters():  # gradients kept between steps are not activations
        parameter.grad = torch.zeros_like(parameter)
    torch.manual_seed(3)
    om(inputs).backward()
    assert om.cache_info()["plans"] == 1  # the plan made by optimize, for training mode
    assert om.stats.measured_peak_bytes <= om.plan.budget_bytes
    torch.manual_seed(3)
    reference(inputs).backward()
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad)


def test_a_stage_switched_to_eval_mode_is_planned_again() -> None:
    """Dropout switched off in one block after optimize: that block saves no mask now, so the
    steps get a plan profiled in the new modes, and follow plain autograd."""
    config = GPTConfig(layers=4, hidden=32, heads=2, seq=32, vocab=64, dropout=0.1)
    model = build_gpt(config, seed=0)
    reference = copy.deepcopy(model)
    inputs = gpt_batch(config, 4)
    om = offremat.optimize(model, inputs, budget=0.5)
    before = om.chain
    for network in (model, reference):
        network.block2.eval()
    torch.manual_seed(4)
    om(inputs).backward()
    assert om.chain is not before and om.cache_info()["plans"] == 1
    torch.manual_seed(4)
    reference(inputs).backward()
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad)


class Widening(nn.Module):
    """A residual MLP block that computes in its own parameters' dtype."""

    def __init__(self, hidden: int = 256) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, hidden), nn.Linear(hidden, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.up.weight.dtype)
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class MeanSquare(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.float().pow(2).mean()


def _unfreeze(model: nn.Sequential) -> None:
    for block in model[2:6]:
        block.requires_grad_(True)


def _to_float32(model: nn.Sequential) -> None:
    for block in model[:3]:  # block 3 stays bfloat16: the same set of dtypes as before
        block.to(torch.float32)


def _widen(model: nn.Sequential) -> None:
    wider = Widening(hidden=320)
    model[1].up, model[1].down = wider.up, wider.down


def _log_activations(model: nn.Sequential) -> None:
    logged: dict[str, torch.Tensor] = {}
    model[1].up.register_forward_hook(
        lambda module, args, output: logged.update(up=output.detach())
    )


@pytest.mark.parametrize("change", [_unfreeze, _to_float32, _widen, _log_activations])
def test_stages_that_save_more_after_optimize_are_planned_again(change) -> None:
    """Layers unfrozen, a block's dtype changed, a submodule widened, a hook that logs
    activations: each makes a stage hold more than it did when profiled, so the next step is
    planned again and fits, measured."""
    from offremat.measure import StepMemory

    torch.manual_seed(0)
    model = nn.Sequential(*[Widening() for _ in range(7)], MeanSquare())
    for block in model[2:6]:
        block.requires_grad_(change is not _unfreeze)
    for block in model[:4]:
        block.to(torch.bfloat16 if change is _to_float32 else torch.float32)
    x = torch.randn(512, 64)
    om = offremat.optimize(model, x, budget=0.6)
    planned = om.chain
    change(model)
    reference = copy.deepcopy(model)
    for parameter in (*model.parameters(), *reference.parameters()):
        parameter.grad = torch.zeros_like(parameter)
    with StepMemory("cpu", x) as memory:
        om(x).backward()
    reference(x).backward()
    assert om.chain is not planned
    assert memory.peak_bytes <= om.plan.budget_bytes
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad)


def test_a_block_replaced_after_optimize_is_refused() -> None:
    """The plan's stages hold the blocks optimize found: one put in a block's place, or a
    block added, would never run in a plan, so the step is refused."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Widening() for _ in range(4)], MeanSquare())
    x = torch.randn(64, 64)
    om = offremat.optimize(model, x, budget=0.9)
    model[1] = Widening()
    with pytest.raises(RuntimeError, match="block '1' of this Sequential changed since"):
        om(x)
    model = nn.Sequential(*[Widening() for _ in range(4)], MeanSquare())
    om = offremat.optimize(model, x, budget=0.9)
    model.insert(4, Widening())
    with pytest.raises(RuntimeError, match="replaced, added or removed"):
        om(x)
    with torch.no_grad():
        om(x)  # without a gradient the model runs as it is
    found = Looped()
    om = offremat.optimize(found, x, budget=0.9)
    found.blocks[2] = Widening()
    with pytest.raises(RuntimeError, match=r"block 'blocks\.2' of this Looped changed since"):
        om(x)
    found = Looped()
    om = offremat.optimize(found, x, budget=0.9)
    found.blocks.append(Widening())  # would run outside the plan
    with pytest.raises(RuntimeError, match="the blocks of 'blocks' of this Looped changed"):
        om(x)


class Looped(nn.Module):
    """Runs its blocks in a loop over a ModuleList: offremat finds the run of blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Widening() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def test_a_step_measured_over_its_budget_is_reported(caplog) -> None:
    """Activation sizes that depend on the input's values: a plan cannot know them, but the
    independent measurement sees the step pass the budget, and says so."""

    class Selecting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(64, 64)

        def forward(self, batch):
            x, gate = batch
            y = self.linear(x)
            chosen = y[gate > 0]
            return torch.tanh(y) + (chosen.unsqueeze(0) * chosen.unsqueeze(1)).sum() * 0, gate

    class Head(nn.Module):
        def forward(self, batch):
            return batch[0].pow(2).mean()

    torch.manual_seed(0)
    model = nn.Sequential(*[Selecting() for _ in range(6)], Head())
    x = torch.randn(16, 64)
    few = -torch.ones(16, 64)
    few[0, :4] = 1
    om = offremat.optimize(model, (x, few), budget=0.5, measure_memory=True)
    for parameter in model.parameters():  # gradients kept between steps are not activations
        parameter.grad = torch.zeros_like(parameter)
    om((x, few)).backward()
    assert "over its budget" not in caplog.text
    for _ in range(2):
        om((x, torch.ones(16, 64))).backward()
        assert om.stats.measured_peak_bytes > om.plan.budget_bytes
    assert caplog.text.count("over its budget") == 1  # once per plan


def test_a_first_step_over_by_its_new_gradients_alone_says_so(caplog) -> None:
    """A step whose parameters' .grad is None allocates them, and the budget leaves them out:
    over the budget by them alone, the warning told the user to keep them between steps
    (which they did) or to lower the budget (a README trial)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(6)]
    model = nn.Sequential(*blocks, nn.Linear(256, 1))
    x = torch.randn(64, 256)
    om = offremat.optimize(model, x, budget=1.0, measure_memory=True)
    om(x).sum().backward()
    assert om.stats.measured_peak_bytes > om.plan.budget_bytes
    assert caplog.text.count("by no more than") == 1
    assert "lower the budget" not in caplog.text
    model.zero_grad(set_to_none=False)
    om(x).sum().backward()
    assert om.stats.measured_peak_bytes <= om.plan.budget_bytes
    assert caplog.text.count("over its budget") == 1


def test_a_sparse_embedding_trains_as_plain_autograd_within_its_budget() -> None:
    """nn.Embedding(sparse=True) makes a sparse gradient, which has no storage of its own: the
    independent measurement counts its indices and values (it used to fail on it)."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 32, sparse=True), *[Block() for _ in range(4)])
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 100, (16, 64))
    om = offremat.optimize(model, ids, budget=0.7, measure_memory=True)
    assert "recompute" in om.plan.decisions.values()
    for network, step in ((model, om), (reference, reference)):
        for parameter in network.parameters():
            parameter.grad = None
        step(ids).square().mean().backward()
    assert om.stats.measured_peak_bytes <= om.plan.budget_bytes
    assert model[0].weight.grad.is_sparse
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine.grad.to_dense(), theirs.grad.to_dense())


def test_blocks_named_in_a_sequential_take_its_batch_as_one_input() -> None:
    """An nn.Sequential takes its batch, a tuple too, as one input: with blocks= its tuple was
    spread into two arguments, and the error was Sequential.forward's TypeError."""
    from offremat._blocks import NotAChainError

    config = GPTConfig(layers=2, hidden=16, heads=2, seq=8, vocab=32)
    model, inputs = build_gpt(config), gpt_batch(config, 2)
    with pytest.raises(NotAChainError, match="no submodule 'nothing'"):
        offremat.optimize(model, inputs, budget=1.0, blocks="nothing")
    with pytest.raises(NotAChainError, match="is a TransformerBlock"):
        offremat.optimize(model, inputs, budget=1.0, blocks="block0")


def test_lazy_modules_not_yet_initialized_are_refused_with_what_to_do() -> None:
    model = torch.nn.Sequential(torch.nn.LazyLinear(8), torch.nn.Tanh(), torch.nn.LazyLinear(1))
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"run it once on a batch"):
        offremat.optimize(model, x, budget=1.0)
    model(x)  # initialises them
    offremat.optimize(model, x, budget=1.0)


def test_a_second_forward_before_the_first_backward_is_said_once(caplog) -> None:
    """Two training forwards before one backward (a siamese pair) hold both steps'
    activations: more than the budget, measured independently, so offremat says so, once per
    model; a forward whose output is dropped, and another model's forward (a GAN's
    discriminator), are no such case. The gradients stay plain autograd's."""
    from offremat.measure import StepMemory

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)])
    other = copy.deepcopy(model)
    reference = copy.deepcopy(model)
    x, y = torch.randn(256, 64), torch.randn(256, 64)
    om = offremat.optimize(model, x, budget=0.8)
    second = offremat.optimize(other, x, budget=0.8)
    for parameter in [*model.parameters(), *reference.parameters()]:
        parameter.grad = torch.zeros_like(parameter)
    om(x).sum().backward()
    om(x)  # dropped: its step closes when its graph goes
    (om(x).sum() + second(y).sum()).backward()
    assert "waits for its backward" not in caplog.text
    for parameter in model.parameters():
        parameter.grad.zero_()
    with StepMemory("cpu", inputs=(x, y)) as memory:
        (om(x) - om(y)).square().mean().backward()
    assert caplog.text.count("waits for its backward") == 1
    assert memory.peak_bytes > om.plan.budget_bytes
    (reference(x) - reference(y)).square().mean().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)
    (om(x) - om(y)).square().mean().backward()
    assert caplog.text.count("waits for its backward") == 1


def test_an_output_without_a_gradient_in_plain_autograd_has_none_here() -> None:
    """Blocks that compute under no_grad (or a reentrant checkpoint of an input that needs no
    gradient): plain autograd's loss has no graph and its backward raises. Offremat's must
    too, rather than run a backward that trains nothing."""

    class Frozen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(32, 32)

        def forward(self, x):
            with torch.no_grad():
                return x + torch.tanh(self.linear(x))

    torch.manual_seed(0)
    model = nn.Sequential(*[Frozen() for _ in range(5)])
    reference = copy.deepcopy(model)
    x = torch.randn(64, 32)
    with pytest.raises(RuntimeError, match="does not require grad") as plain:
        reference(x).square().mean().backward()
    for solver, options in [("offload-all", {"bandwidth": 1e9}), ("dp", {})]:
        om = offremat.optimize(model, x, budget=0.9, solver=solver, **options)
        assert om.plan.decisions != {str(k): "keep" for k in range(5)}
        loss = om(x).square().mean()
        assert not loss.requires_grad
        with pytest.raises(RuntimeError) as ours:
            loss.backward()
        assert str(ours.value) == str(plain.value)


def test_saved_tensor_hooks_around_a_planned_step_are_refused() -> None:
    """Activation compression around the step: plain autograd packs every saved tensor with
    the caller's hooks, the executor's own hooks are innermost and would bypass them."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(5)])
    x = torch.randn(64, 32)
    packed = []

    def compress(t: torch.Tensor) -> torch.Tensor:
        packed.append(t.shape)
        return t.to(torch.bfloat16)

    hooks = torch.autograd.graph.saved_tensors_hooks(compress, lambda t: t.float())
    om = offremat.optimize(model, x, budget=0.9)
    assert "recompute" in om.plan.decisions.values()
    with pytest.raises(RuntimeError, match="saved_tensors_hooks"), hooks:
        om(x)
    with (
        pytest.raises(RuntimeError, match="saved_tensors_hooks"),
        torch.autograd.graph.save_on_cpu(),
    ):
        om(x)
    whole = offremat.optimize(model, x, budget=1.0)  # plain autograd's schedule: runs as such
    with hooks:
        loss = whole(x).sum()
    loss.backward()
    assert packed


def test_allowing_mutation_on_saved_tensors_is_refused_naming_the_context() -> None:
    """Under allow_mutation_on_saved_tensors plain autograd trains a block that changes a
    tensor it saved; its copies are made by saved-tensor hooks, which a plan's own replace:
    the step and optimize raised autograd's in-place error, not naming the context."""

    class ChangesASavedTensor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.linear(x))
            y = h * h
            h.add_(1.0)  # h is saved by h * h
            return x + y

    torch.manual_seed(0)
    model = nn.Sequential(*[ChangesASavedTensor() for _ in range(4)])
    x = torch.randn(64, 32)
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        model(x).sum().backward()  # plain autograd trains it there
        with pytest.raises(RuntimeError, match=r"optimize is called inside .*allow_mutation"):
            offremat.optimize(model, x, budget=0.9)
    om = offremat.optimize(nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)]), x, budget=0.8)
    assert "recompute" in om.plan.decisions.values()
    with (
        torch.autograd.graph.allow_mutation_on_saved_tensors(),
        pytest.raises(RuntimeError, match=r"training step runs inside .*allow_mutation"),
    ):
        om(x)


def test_a_planned_step_with_saved_tensor_hooks_disabled_is_refused_with_what_to_do() -> None:
    """Under disable_saved_tensors_hooks plain autograd trains, but the executor's own hooks
    raised torch's error with the caller's message from inside the step (and from inside
    optimize's profile): both are refused up front saying why, and a keep-all plan runs as
    plain autograd there."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(5)])
    reference = copy.deepcopy(model)
    x = torch.randn(64, 32)
    om = offremat.optimize(model, x, budget=0.9)
    whole = offremat.optimize(model, x, budget=1.0)
    assert "recompute" in om.plan.decisions.values()
    assert set(whole.plan.decisions.values()) == {"keep"}
    disabled = torch.autograd.graph.disable_saved_tensors_hooks("no hooks in this region")
    with disabled:
        with pytest.raises(RuntimeError, match=r"disable_saved_tensors_hooks.*its own.*om\.model"):
            om(x)
        with pytest.raises(
            RuntimeError, match=r"optimize is called inside .*disable_saved_tensors_hooks"
        ):
            offremat.optimize(model, x, budget=0.9)
        with pytest.raises(RuntimeError, match=r"offremat profiles a stage inside"):
            profile_model(model, x, warmup=0, repeats=1)  # as a new shape in a step would be
        whole(x).sum().backward()
        reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    # The forward outside, the backward inside: a recomputation raised torch's error from
    # inside the backward (review). Refused before any stage's backward runs.
    loss = om(x).sum()
    disabled = torch.autograd.graph.disable_saved_tensors_hooks("no hooks in this region")
    with disabled, pytest.raises(RuntimeError, match=r"backward recomputes, and runs inside"):
        loss.backward()
    om(x).sum().backward()
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_steps_offremat_cannot_run_as_planned_say_why() -> None:
    """A torch.func transform around a planned step (a keep-all plan runs as plain autograd
    under it), and a block frozen between the forward and the backward of a recomputed
    stage: each gets a message that says what to do."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(5)])
    x = torch.randn(64, 32)
    om = offremat.optimize(model, x, budget=0.9)
    assert om.plan.decisions["1"] == "recompute"
    weights = {name: p.detach() for name, p in model.named_parameters()}

    def loss_of(step):
        return lambda w: torch.func.functional_call(step, w, (x,)).sum()

    with pytest.raises(RuntimeError, match=r"torch\.func transform"):
        torch.func.grad(loss_of(om))(weights)
    whole = offremat.optimize(model, x, budget=1.0)
    ours = torch.func.grad(loss_of(whole))(weights)
    theirs = torch.func.grad(loss_of(model))(weights)
    assert all(torch.equal(ours[name], theirs[name]) for name in weights)
    loss = om(x).sum()
    model[1].requires_grad_(False)
    with pytest.raises(RuntimeError, match="stage '1' started or stopped requiring grad"):
        loss.backward()


@pytest.mark.parametrize("transform", ["jacrev", "vjp", "forward AD", "parametrize.cached"])
def test_transforms_only_plain_autograd_runs_are_refused_unless_the_plan_is_plain(transform):
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(5)])
    if transform == "parametrize.cached":
        nn.utils.parametrizations.weight_norm(model[2][0])
    x = torch.randn(32, 16)

    def step(network: nn.Module) -> torch.Tensor:
        if transform == "jacrev":
            return torch.func.jacrev(lambda v: network(v).sum())(x)
        if transform == "vjp":
            return torch.func.vjp(network, x)[1](torch.ones(32, 16))[0]
        if transform == "forward AD":
            with torch.autograd.forward_ad.dual_level():
                dual = torch.autograd.forward_ad.make_dual(x, torch.ones_like(x))
                return torch.autograd.forward_ad.unpack_dual(network(dual)).tangent
        with parametrize.cached():
            loss = network(x).sum()
        loss.backward()
        return model[2][0].parametrizations.weight.original0.grad.clone()

    om = offremat.optimize(model, x, budget=0.9)
    assert "recompute" in om.plan.decisions.values()
    with pytest.raises(RuntimeError, match=r"torch\.func|dual tensors|parametrize\.cached"):
        step(om)
    if transform in ("jacrev", "vjp"):
        return  # the transform's input is a shape no plan was made for: nothing runs plainly
    model.zero_grad()
    theirs = step(model)
    model.zero_grad()
    ours = step(offremat.optimize(model, x, budget=1.0))  # plain autograd's schedule
    assert torch.equal(ours, theirs)


def test_a_dataclass_of_tensors_between_stages_is_refused_with_what_to_pass() -> None:
    @dataclasses.dataclass
    class State:
        hidden: torch.Tensor

    class Wrap(nn.Module):
        def forward(self, x: torch.Tensor) -> State:
            return State(x)

    class Unwrap(nn.Linear):
        def forward(self, state: State) -> torch.Tensor:
            return super().forward(state.hidden)

    model = nn.Sequential(nn.Linear(8, 8), Wrap(), Unwrap(8, 8), nn.Linear(8, 8))
    with pytest.raises(TypeError, match=r"a dataclass State holding tensors .* namedtuple"):
        offremat.optimize(model, torch.randn(4, 8), budget=0.5)

    # Given as the whole input, or inside another dataclass, it was "the example batch holds
    # no tensor".
    @dataclasses.dataclass
    class Outer:
        state: State

    for batch in (State(torch.randn(4, 8)), Outer(State(torch.randn(4, 8)))):
        with pytest.raises(TypeError, match=r"holding tensors .* namedtuple"):
            offremat.optimize(nn.Sequential(Unwrap(8, 8), nn.Linear(8, 8)), batch)


class WeightNormedHead(nn.Module):
    """Blocks, then a parametrized head outside every stage, and a target in a dataclass."""

    @dataclasses.dataclass
    class Target:
        values: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6))
        self.head = nn.utils.parametrizations.weight_norm(nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, target: Target) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return (self.head(x) - target.values).square().mean()


def test_what_no_stage_sees_is_not_refused() -> None:
    """A parametrized head outside the stages under parametrize.cached(), and a dataclass the
    model's own forward reads: they run as the model runs them, bit-equal."""
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    model = WeightNormedHead()
    reference = copy.deepcopy(model)
    x, target = torch.randn(512, 32), WeightNormedHead.Target(torch.randn(512, 1))
    om = offremat.optimize(model, {"x": x, "target": target}, budget=0.8, blocks="blocks")
    assert "recompute" in om.plan.decisions.values()
    for network in (om, reference):
        with parametrize.cached():
            network(x, target).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_a_model_that_holds_an_optimized_model_is_refused() -> None:
    torch.manual_seed(0)
    inner = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    x = torch.randn(256, 8)
    om = offremat.optimize(inner, x, budget=0.9)
    for outer in (om, nn.Sequential(nn.Linear(8, 8), om, nn.Linear(8, 8))):
        with pytest.raises(TypeError, match=r"already optimized.*OptimizedModule\.model"):
            offremat.optimize(outer, x, budget=0.9)


class Scaled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() / 255


@pytest.mark.parametrize("first", [Scaled(), nn.Embedding(100, 32)], ids=["image", "tokens"])
def test_an_input_made_under_inference_mode_is_taken_as_plain_autograd_takes_it(first) -> None:
    """A uint8 image scaled in the first block trains; token ids an embedding saves for its
    backward raise plain autograd's own error."""
    torch.manual_seed(0)
    model = nn.Sequential(first, *[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
    reference = copy.deepcopy(model)
    x = torch.randint(0, 100, (64, 32) if isinstance(first, Scaled) else (64,))
    om = offremat.optimize(model, x, budget=0.95)
    assert "recompute" in om.plan.decisions.values()
    with torch.inference_mode():
        made = x.clone()
    try:
        reference(made).square().mean().backward()
    except RuntimeError as error:
        with pytest.raises(RuntimeError, match="Inference tensors cannot be saved"):
            om(made).square().mean().backward()
        assert "cannot be saved" in str(error)
        return
    om(made).square().mean().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)


def test_autograd_grad_with_respect_to_the_parameters_is_said_at_the_next_step(caplog) -> None:
    """The chain's graph does not reach its parameters (README), so torch.autograd.grad with
    respect to them gives None with allow_unused: the step that never ran its backward is
    named at the next forward, with what to use instead."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)])
    x = torch.randn(256, 64)
    om = offremat.optimize(model, x, budget=0.8)
    loss = om(x).sum()
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    assert all(g is None for g in grads)
    loss = om(x).sum()
    assert "torch.autograd.grad" in caplog.text and "loss.backward()" in caplog.text


def test_a_given_plan_that_offloads_asks_for_the_bandwidth(tmp_path) -> None:
    # Without it the profiled chain has no link, and the simulator's "add a 'link'" named a
    # field of the chain format, which the Python API does not write (the trial).
    model, (x, _) = mlp(), batch()
    first = offremat.optimize(model, x, budget=0.9, solver="offload-all", bandwidth="10GB/s")
    first.plan.save(tmp_path / "plan.json")
    with pytest.raises(ValueError, match="pass optimize the bandwidth it was solved with"):
        offremat.optimize(mlp(), x, plan=tmp_path / "plan.json")
    again = offremat.optimize(mlp(), x, plan=tmp_path / "plan.json", bandwidth="10GB/s")
    assert again.plan.ops == first.plan.ops


def test_a_chain_of_a_models_blocks_made_for_another_batch_is_refused(tmp_path) -> None:
    """As for an nn.Sequential: a chain of a model's blocks profiled on a batch of 256 rows,
    given with one of 512, took its budget as a fraction of the smaller batch's keep-all
    peak (9.72 MiB for 40%, where the batch's own profile gives 19.05: a new user's trial)."""
    from tests.model_zoo import ResidualNet

    torch.manual_seed(0)
    model = ResidualNet()
    small, large = torch.randn(16, 16), torch.randn(32, 16)
    offremat.optimize(model, small, budget=0.5).chain.save(tmp_path / "chain.json")
    with pytest.raises(ValueError, match="blocks' input had shapes"):
        offremat.optimize(model, large, chain=tmp_path / "chain.json", budget=0.5)
    offremat.optimize(model, small, chain=tmp_path / "chain.json", budget=0.5)


def test_a_misspelt_solver_option_is_refused_before_profiling(monkeypatch) -> None:
    import offremat._building

    def never(*args, **kwargs):
        raise AssertionError("profiled before the options were checked")

    monkeypatch.setattr(offremat._building, "profile_model_chain", never)
    monkeypatch.setattr(offremat._building, "profile_model", never)
    with pytest.raises(ValueError, match="does not take option"):
        offremat.optimize(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4), time_limt_s=5)
