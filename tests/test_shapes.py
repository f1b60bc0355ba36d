"""A training step never runs on a plan made for another input shape (Mimose's promise)."""

from __future__ import annotations

import copy
import functools
import gc
import os
import pickle
import subprocess
import sys
import types
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offremat
from offremat.measure import StepMemory
from solvers.chain import Chain, Stage
from tests import model_zoo as zoo


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(6)]
    )


def step(model, x, target) -> torch.Tensor:
    # A loss that allocates nothing of its own: the budget covers the model and the gradient
    # it is seeded with, while what a caller's loss allocates is the caller's (see README).
    loss = (model(x) - target).sum()
    loss.backward()
    return loss.detach()


def check_step(om, model, reference, x, target) -> None:
    """One step of ``om`` against plain autograd: equal loss and gradients, peak in budget."""
    for parameter in (*model.parameters(), *reference.parameters()):
        parameter.grad = torch.zeros_like(parameter)
    # The budget counts the model's input, not the loss's target (the caller's).
    with StepMemory("cpu", inputs=x) as memory:
        loss = step(om, x, target)
    assert torch.equal(loss, step(reference, x, target))
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert memory.peak_bytes <= om.plan.budget_bytes, len(x)


def test_each_new_batch_size_gets_its_own_plan_within_the_same_byte_budget() -> None:
    model = mlp()
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    om = offremat.optimize(model, torch.randn(64, 64), budget=2_000_000)
    assert om.plan.budget_bytes == 2_000_000
    decisions = {}
    for rows in (64, 256, 128, 64, 256):
        x = torch.randn(rows, 64, generator=generator)
        check_step(om, model, reference, x, torch.randn(rows, 64, generator=generator))
        assert om.plan.budget_bytes == 2_000_000
        assert om.chain.input_bytes == x.numel() * 4
        decisions[rows] = set(om.plan.decisions.values())
    assert decisions[64] == {"keep"} and "recompute" in decisions[256]  # one plan would not do
    info = om.cache_info()
    assert (info["plans"], info["misses"], info["hits"]) == (3, 2, 3)


def test_a_shape_too_large_for_the_budget_is_refused_before_it_runs() -> None:
    model = mlp()
    om = offremat.optimize(model, torch.randn(64, 64), budget=2_000_000)
    x = torch.randn(8192, 64)
    with pytest.raises(offremat.InfeasibleBudgetError, match=r"for input \(8192, 64\) float32"):
        om(x)
    assert all(p.grad is None for p in model.parameters())


def test_a_new_sequence_length_gets_its_own_plan_for_a_hugging_face_model() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = zoo.gpt2().train()
    reference = copy.deepcopy(model)
    short = torch.randint(0, 96, (4, 32))
    om = offremat.optimize(model, {"input_ids": short, "labels": short}, budget=0.5)
    budget = om.plan.budget_bytes
    for ids in (torch.randint(0, 96, (4, 64)), short):
        for parameter in (*model.parameters(), *reference.parameters()):
            parameter.grad = torch.zeros_like(parameter)
        torch.manual_seed(3)
        with StepMemory("cpu", inputs=ids) as memory:
            loss = om(input_ids=ids, labels=ids).loss
            loss.backward()
        torch.manual_seed(3)
        reference(input_ids=ids, labels=ids).loss.backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        assert memory.peak_bytes <= budget
    assert om.cache_info()["plans"] == 2


@pytest.mark.parametrize(("fraction", "dropout"), [(0.7, 0.1), (0.6, 0.0), (0.7, 0.0)])
def test_padding_of_the_same_shape_gets_a_plan_for_the_blocks_inputs_it_makes(
    fraction, dropout
) -> None:
    """Llama's sdpa blocks get no mask where the attention mask is all ones, and a 4-d mask
    where a batch of the same shape is padded: they save more then (4.3% and 7.8% over the
    budget on the example's plan at 60% and 70%, without dropout). The padded steps get a plan
    of their own, profiled inside the step without drawing its random numbers (dropout on),
    within the budget and bit-equal to plain autograd; the unpadded one keeps the example's."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = zoo.llama(attn_implementation="sdpa", attention_dropout=dropout).train()
    reference = copy.deepcopy(model)
    ids = torch.randint(3, 96, (4, 128), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 128, dtype=torch.long)
    padded_mask = mask.clone()
    padded_mask[1, 100:] = 0
    padded_mask[3, 64:] = 0
    example = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    padded = {"input_ids": ids, "attention_mask": padded_mask, "labels": ids}
    om = offremat.optimize(model, example, budget=fraction)
    budget = om.plan.budget_bytes
    for batch in (padded, example, padded):
        for parameter in (*model.parameters(), *reference.parameters()):
            parameter.grad = torch.zeros_like(parameter)
        torch.manual_seed(3)
        with StepMemory("cpu", inputs=batch) as memory:
            om(**batch).loss.backward()
        torch.manual_seed(3)
        reference(**batch).loss.backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        assert memory.peak_bytes <= budget, (memory.peak_bytes, budget)
    info = om.cache_info()
    assert (info["plans"], info["variants"], info["misses"], info["hits"]) == (2, 1, 0, 3)


def test_padding_on_a_predicted_length_gets_a_plan_within_the_budget() -> None:
    """Lengths between profiled ones are predicted, and their blocks never ran: a padded
    batch there gets a plan of its own too, with the costs around the blocks bounded by the
    predicted chain's figures (1.06x the budget at 96 on the predicted plan before)."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = zoo.llama(attn_implementation="sdpa").train()
    reference = copy.deepcopy(model)
    ids = torch.randint(3, 96, (4, 128), generator=torch.Generator().manual_seed(0))
    om = offremat.optimize(
        model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}, 0.7
    )
    budget = om.plan.budget_bytes
    for length, padded in ((64, False), (96, False), (96, True)):
        mask = torch.ones(4, length, dtype=torch.long)
        if padded:
            mask[1, length * 3 // 4 :] = 0
            mask[3, length // 2 :] = 0
        cut = ids[:, :length].contiguous()  # as a loader's batch: a view is another layout
        batch = {"input_ids": cut, "attention_mask": mask, "labels": cut}
        for parameter in (*model.parameters(), *reference.parameters()):
            parameter.grad = torch.zeros_like(parameter)
        with StepMemory("cpu", inputs=batch) as memory:
            om(**batch).loss.backward()
        reference(**batch).loss.backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        assert memory.peak_bytes <= budget, (length, padded, memory.peak_bytes, budget)
    info = om.cache_info()
    assert (info["predicted"], info["variants"]) == (1, 1)


def test_a_length_predicted_from_padded_and_unpadded_profiles_plans_each_kind() -> None:
    """Qwen2 optimized on a padded batch of 32, then unpadded at 64: a padded 48 is predicted
    from chains of two kinds, which predict neither's bytes (1.018x the budget at 62% on the
    predicted plan before): it gets a plan of its own, within the budget."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = zoo.qwen2().train()
    reference = copy.deepcopy(model)
    ids = torch.randint(3, 96, (4, 64), generator=torch.Generator().manual_seed(0))

    def batch(length: int, padded: bool) -> dict[str, torch.Tensor]:
        mask = torch.ones(4, length, dtype=torch.long)
        if padded:
            mask[1, length * 3 // 4 :] = 0
            mask[3, length // 2 :] = 0
        cut = ids[:, :length].contiguous()  # as a loader's batch: a view is another layout
        return {"input_ids": cut, "attention_mask": mask, "labels": cut}

    with StepMemory("cpu", inputs=batch(48, True)) as plain:
        copy.deepcopy(model)(**batch(48, True)).loss.backward()
    budget = int(0.62 * plain.peak_bytes)
    om = offremat.optimize(model, batch(32, True), budget)
    for length, padded in ((64, False), (48, True)):
        for parameter in (*model.parameters(), *reference.parameters()):
            parameter.grad = torch.zeros_like(parameter)
        with StepMemory("cpu", inputs=batch(length, padded)) as memory:
            om(**batch(length, padded)).loss.backward()
        reference(**batch(length, padded)).loss.backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        assert memory.peak_bytes <= budget, (length, padded, memory.peak_bytes, budget)
    assert (om.cache_info()["predicted"], om.cache_info()["variants"]) == (1, 1)


class MaskedBlock(nn.Module):
    """Attends over the rows where a mask is given (it saves an (n, n) product then)."""

    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x, mask=None, scale: float = 1.0):
        h = self.up(x)
        if mask is not None:
            h = torch.softmax((h @ h.transpose(-1, -2)).masked_fill(~mask, -1e4), -1) @ h
        return x + self.down(torch.relu(h)) * scale


class MaskedNet(nn.Module):
    """Gives its blocks no mask where nothing is padded, and a number from the batch."""

    def __init__(self, width: int = 32, depth: int = 6):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(MaskedBlock(width) for _ in range(depth))

    def forward(self, x, mask):
        h = self.embed(x)
        pairs = None if bool(mask.all()) else mask[:, :, None] & mask[:, None, :]
        scale = 1.0 / float(mask.sum())
        for block in self.blocks:
            h = block(h, mask=pairs, scale=scale)
        return h.square().mean()


def masked_batches() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 64, 8, generator=torch.Generator().manual_seed(0))
    ones = torch.ones(8, 64, dtype=torch.bool)
    padded = ones.clone()
    padded[2, 40:] = False
    return x, ones, padded


def test_a_number_the_model_hands_its_blocks_is_not_a_new_kind_of_input() -> None:
    """A scale computed from the batch differs at every step; only the blocks' tensors (and
    which are None) decide what they save, so the padded steps share one plan (each had
    planned again, every step)."""
    torch.manual_seed(0)
    x, ones, _ = masked_batches()
    om = offremat.optimize(MaskedNet(), (x, ones), budget=0.7)
    for k in range(3):
        mask = ones.clone()
        mask[0, 60 - k :] = False  # another count, so another scale, at each step
        om(x, mask).backward()
    info = om.cache_info()
    assert (info["plans"], info["variants"], info["misses"]) == (2, 1, 0)


def test_a_recomputing_plan_for_padded_blocks_is_refused_inside_parametrize_cached() -> None:
    """The example's plan runs plainly, which parametrize.cached() allows; the padded
    inputs' plan recomputes, so it is refused as any recomputing plan is there (it had
    failed in its refill), and runs bit-equal outside cached()."""
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    model = MaskedNet()
    for block in model.blocks:
        weight_norm(block.up)
    reference = copy.deepcopy(model)
    x, ones, padded = masked_batches()
    om = offremat.optimize(model, (x, ones), budget=1.0)
    with parametrize.cached():
        om(x, ones).backward()
    with parametrize.cached(), pytest.raises(RuntimeError, match=r"parametrize\.cached"):
        om(x, padded)
    for parameter in (*model.parameters(), *reference.parameters()):
        parameter.grad = None
    om(x, padded).backward()
    reference(x, padded).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_a_kind_of_blocks_inputs_no_plan_fits_is_refused_again_without_planning() -> None:
    """The refusal comes once the code before the blocks has run (inside the model's
    forward), and is remembered: a later such step is refused at once."""
    torch.manual_seed(0)
    x, ones, padded = masked_batches()
    om = offremat.optimize(MaskedNet(), (x, ones), budget=0.45)
    for _ in range(2):
        with pytest.raises(offremat.InfeasibleBudgetError, match="another kind"):
            om(x, padded)
    assert om.cache_info()["variants"] == 1
    om(x, ones).backward()  # the example's kind still runs
    # Nothing of the refused steps stays (a stored error kept their frames, and could not be
    # copied): the model deep-copies, and the refused batch is freed.
    copy.deepcopy(om)
    refused_batch = padded.clone()
    alive = weakref.ref(refused_batch)
    with pytest.raises(offremat.InfeasibleBudgetError):
        om(x, refused_batch)
    del refused_batch
    gc.collect()
    assert alive() is None
    refused = offremat.InfeasibleBudgetError(1, 2, "dp", "x", cause="hooks added")
    assert pickle.loads(pickle.dumps(refused)).shape == "x"
    assert str(pickle.loads(pickle.dumps(refused))) == str(refused)


def test_plans_are_kept_on_disk_and_a_bad_cache_file_is_ignored(tmp_path, caplog, monkeypatch):
    import offremat._building

    model = mlp()
    x64, x128 = torch.randn(64, 64), torch.randn(128, 64)
    om = offremat.optimize(model, x64, budget=2_000_000, cache_dir=tmp_path)
    first_ops = om.plan.ops
    om(x128)
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 2

    def no_profiling(*args, **kwargs):
        raise AssertionError("profiled although the plan was on disk")

    monkeypatch.setattr(offremat._building, "profile_model", no_profiling)
    again = offremat.optimize(mlp(), x64, budget=2_000_000, cache_dir=tmp_path)
    assert again.cache_info()["from_disk"] == 1  # the example's plan
    again(x128)
    assert again.cache_info()["from_disk"] == 2
    assert again.plan.ops == om.plan.ops
    monkeypatch.undo()

    for file in files:
        file.write_text(file.read_text()[:100])  # truncated
    with caplog.at_level("WARNING"):
        third = offremat.optimize(mlp(), x64, budget=2_000_000, cache_dir=tmp_path)
    assert "ignoring plan cache file" in caplog.text
    assert third.plan.ops == first_ops
    caplog.clear()
    with caplog.at_level("WARNING"):
        offremat.optimize(mlp(), x64, budget=1_900_000, cache_dir=tmp_path)
    assert "ignoring" not in caplog.text  # another budget is another entry, not a foreign one


class _PlainConfig:
    """A config of a plain class: no dataclass, no to_dict."""

    def __init__(self, **settings) -> None:
        self.__dict__.update(settings)


def test_a_cached_plan_is_not_read_for_a_model_with_other_settings(tmp_path) -> None:
    # A dropout's p or a count of attention heads changes what the forward saves, with the
    # same parameters: a plan cached for one must not be read for the other.
    from offremat._fingerprint import model_fingerprint
    from offremat.models import GPTConfig, build_gpt, gpt_batch

    def gpt(heads: int, dropout: float) -> torch.nn.Module:
        config = GPTConfig(layers=4, hidden=32, heads=heads, seq=32, vocab=64, dropout=dropout)
        return build_gpt(config, seed=0)

    assert model_fingerprint(gpt(2, 0.0)) == model_fingerprint(gpt(2, 0.0))
    assert model_fingerprint(gpt(2, 0.0)) != model_fingerprint(gpt(2, 0.1))
    assert model_fingerprint(gpt(2, 0.0)) != model_fingerprint(gpt(4, 0.0))
    # A nanoGPT-style config, a dict, a plain class's object (its settings nested too).
    for config, changed in (
        (GPTConfig(heads=2), GPTConfig(heads=16)),
        ({"heads": 2}, {"heads": 16}),
        (_PlainConfig(heads=2), _PlainConfig(heads=16)),
        (_PlainConfig(attention=_PlainConfig(heads=2)), _PlainConfig(attention=_PlainConfig())),
    ):
        holder, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        holder.config, other.config = config, changed
        assert model_fingerprint(holder) != model_fingerprint(other)
    batch = gpt_batch(GPTConfig(layers=4, hidden=32, heads=2, seq=32, vocab=64), 4)
    first = offremat.optimize(gpt(2, 0.0), batch, budget=0.7, cache_dir=tmp_path)
    second = offremat.optimize(gpt(2, 0.1), batch, budget=0.7, cache_dir=tmp_path)
    fresh = offremat.optimize(gpt(2, 0.1), batch, budget=0.7)
    assert len(list(tmp_path.glob("*.json"))) == 2
    assert second.plan.budget_bytes == fresh.plan.budget_bytes != first.plan.budget_bytes


def _keep_last(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    module.last = output  # logging code keeping each block's activation


class _Keeps:
    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        module.last = output


class _Counts:
    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        module.calls = getattr(module, "calls", 0) + 1


def test_a_cached_plan_is_not_read_for_a_model_with_other_hooks(tmp_path) -> None:
    # A forward hook that keeps an activation changes what a step holds: a plan cached
    # without it must not be read with it (its first step measured 1.28 times its budget).
    from offremat._fingerprint import model_fingerprint

    def hooked(hook) -> nn.Sequential:
        model = mlp()
        if hook is not None:
            for block in model:
                block[0].register_forward_hook(hook)
        return model

    assert model_fingerprint(hooked(None)) != model_fingerprint(hooked(_keep_last))
    assert model_fingerprint(hooked(_keep_last)) == model_fingerprint(hooked(_keep_last))
    # A callable object is known by its class's __call__ (here two classes of one name, as
    # one class before and after an edit): keeping or not is in the key.
    keeps = type("Hook", (), {"__call__": _Keeps.__call__})
    counts = type("Hook", (), {"__call__": _Counts.__call__})
    assert model_fingerprint(hooked(keeps())) != model_fingerprint(hooked(counts()))
    x = torch.randn(32, 64)
    offremat.optimize(hooked(None), x, budget=0.6, cache_dir=tmp_path)
    om = offremat.optimize(hooked(_keep_last), x, budget=0.6, cache_dir=tmp_path)
    assert om.cache_info()["from_disk"] == 0
    again = offremat.optimize(hooked(_keep_last), x, budget=0.6, cache_dir=tmp_path)
    assert again.cache_info()["from_disk"] == 1


def _logged(forward):
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)

    return wrapper


class ReluBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class EditedBlock(ReluBlock):
    """ReluBlock with its forward edited (saves more): the same types and tensors otherwise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return torch.tanh(h) * torch.sigmoid(h)


def test_a_cached_plan_is_not_read_after_the_forward_code_changed() -> None:
    from offremat._fingerprint import model_fingerprint

    edited = EditedBlock()
    EditedBlock.__qualname__ = ReluBlock.__qualname__  # as if the file had been edited
    try:
        assert model_fingerprint(ReluBlock()) != model_fingerprint(edited)
        for block in (ReluBlock, EditedBlock):  # decorated, as Hugging Face's forwards are
            block.forward = _logged(block.__dict__["forward"])
        assert model_fingerprint(ReluBlock()) != model_fingerprint(edited)
    finally:
        EditedBlock.__qualname__ = "EditedBlock"
        for block in (ReluBlock, EditedBlock):
            block.forward = block.__dict__["forward"].__wrapped__
    # The digest is the same in another process, whatever its hash seed, with a frozenset
    # among the forward's constants (whose order follows the seed).
    script = (
        "import torch\n"
        "from offremat._fingerprint import model_fingerprint\n"
        "class Gated(torch.nn.Linear):\n"
        "    def forward(self, x):\n"
        "        return x if self.mode in {'off', 'skip', 'none', 'identity'} else x * 2\n"
        "block = Gated(2, 2)\n"
        "block.mode = 'on'\n"
        "print(model_fingerprint(block))"
    )
    assert len(_printed_under_hash_seeds(script, ("1", "2", "3"))) == 1


def test_a_hugging_face_model_s_key_is_the_same_in_every_process() -> None:
    pytest.importorskip("transformers")
    script = (
        "from offremat._fingerprint import model_fingerprint\n"
        "from tests import model_zoo\n"
        "print(model_fingerprint(model_zoo.gpt2()))"
    )
    assert len(_printed_under_hash_seeds(script, ("1", "2"))) == 1


def _printed_under_hash_seeds(script: str, seeds: tuple[str, ...]) -> set[str]:
    """What ``script`` prints, run in a process of its own under each hash seed."""
    return {
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in seeds
    }


def _helper(h: torch.Tensor) -> torch.Tensor:
    return torch.relu(h)


def _edited_helper(h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h) * torch.sigmoid(h)


class ActivationBlock(nn.Module):
    """Calls its activation through an attribute, as ``nn.TransformerEncoderLayer`` does."""

    def __init__(self, activation) -> None:
        super().__init__()
        self.up, self.down, self.activation = nn.Linear(64, 256), nn.Linear(256, 64), activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.activation(self.up(x)))


class HelperBlock(ReluBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._inner(x)

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        return _helper(self.linear(x))


def _slower_silu(x: torch.Tensor) -> torch.Tensor:  # saves three times what F.silu does
    return x * torch.sigmoid(x) * torch.tanh(torch.exp(-x * x) + 1)


def test_a_cached_plan_is_not_read_after_a_function_the_forward_reaches_changed(
    tmp_path, monkeypatch
) -> None:
    from offremat import _fingerprint
    from offremat._fingerprint import model_fingerprint

    before = model_fingerprint(HelperBlock())
    monkeypatch.setitem(globals(), "_helper", _edited_helper)  # as if the file had been edited
    assert model_fingerprint(HelperBlock()) != before
    monkeypatch.setitem(globals(), "_helper", globals()["_helper"])
    x = torch.randn(256, 64)

    def build(activation) -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[ActivationBlock(activation) for _ in range(6)])

    # With F.silu the plan fits 2 MB; with _slower_silu no plan does.
    offremat.optimize(build(torch.nn.functional.silu), x, budget=2_000_000, cache_dir=tmp_path)
    with pytest.raises(offremat.InfeasibleBudgetError):
        offremat.optimize(build(_slower_silu), x, budget=2_000_000, cache_dir=tmp_path)
    # Another version of offremat's code (or of torch) does not read the plans either.
    again = offremat.optimize(
        build(torch.nn.functional.silu), x, budget=2_000_000, cache_dir=tmp_path
    )
    assert again.cache_info()["from_disk"] == 1
    monkeypatch.setattr(_fingerprint, "_source_digest", lambda: "another version")
    other = offremat.optimize(
        build(torch.nn.functional.silu), x, budget=2_000_000, cache_dir=tmp_path
    )
    assert other.cache_info()["from_disk"] == 0


_helpers = types.ModuleType("_helpers")  # a module of helpers the block calls as _helpers.act
exec("import torch\ndef act(x):\n    return torch.tanh(x)\n", _helpers.__dict__)


class ModuleHelperBlock(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _helpers.act(super().forward(x))


def test_a_function_reached_as_an_attribute_of_a_module_is_in_the_key(monkeypatch) -> None:
    from offremat._fingerprint import model_fingerprint

    before = model_fingerprint(ModuleHelperBlock(4, 4))
    edited: dict = {}
    exec("import torch\ndef act(x):\n    return torch.tanh(torch.cat([x, x]))\n", edited)
    monkeypatch.setattr(_helpers, "act", edited["act"])  # as if helpers.py had been edited
    assert model_fingerprint(ModuleHelperBlock(4, 4)) != before


class CachedMask(nn.Module):
    """Keeps a buffer shaped by the last input: a mask cached for the last sequence length."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("mask", torch.ones(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mask.shape[0] != x.shape[1]:
            self.mask = torch.ones(x.shape[1])
        return torch.tanh(self.linear(x)) * self.mask[:, None]


def test_a_buffer_that_follows_the_input_shape_keeps_each_shape_s_plan() -> None:
    model = nn.Sequential(*[CachedMask() for _ in range(3)], nn.Linear(8, 1))
    short, long = torch.randn(2, 6, 8), torch.randn(2, 9, 8)
    om = offremat.optimize(model, short, budget=2**20)
    for _ in range(2):
        for x in (short, long):
            om(x).sum().backward()
    assert om.cache_info()["plans"] == 2 and om.cache_info()["misses"] == 1


def test_a_shape_is_predicted_along_one_dimension_of_each_tensor_only() -> None:
    # An image's height and width growing together grow its patch attention as their product
    # squared, beyond the quadratic the predictor fits: such a shape is profiled for real.
    from offremat._signatures import differing_size, input_signature

    def images(side: int) -> tuple:
        return input_signature(torch.zeros(2, 3, side, side))

    def tokens(length: int) -> tuple:
        return input_signature((torch.zeros(2, length), torch.ones(2, length)))

    assert differing_size(images(32), images(48)) is None
    assert differing_size(tokens(32), tokens(48)) is not None  # ids and mask: one size


def _growing(power: int, sizes: tuple[int, ...]) -> list[tuple[int, Chain]]:
    """Profiled chains of one stage whose saved bytes grow as ``size ** power``."""
    chains = []
    for n in sizes:
        stage = Stage("s", 1e-3, 2e-3, out_bytes=n, saved_bytes=2 * n**power)
        chains.append((n, Chain("c", 1000, (stage,))))
    return chains


@pytest.mark.parametrize(
    ("power", "sizes", "unseen"),
    [
        (3, (8, 16, 32), 11),  # triangle attention: a quadratic through these is 24% low at 11
        (3, (8, 16, 24, 32), 11),
        (4, (16, 32, 64), 24),  # the quadratic through these dips below the bytes at 16
        (2, (16, 32, 64), 24),
    ],
)
def test_predicted_bytes_between_profiled_sizes_are_never_below_the_truth(
    power: int, sizes: tuple[int, ...], unseen: int
) -> None:
    from solvers.predict import predict_chain

    predicted = predict_chain(_growing(power, sizes), unseen)
    assert predicted is not None
    assert predicted.stages[0].saved_bytes >= 2 * unseen**power
    assert predicted.stages[0].out_bytes == unseen  # linear: the chord is exact


def test_bytes_that_bend_down_at_a_profiled_size_are_not_predicted() -> None:
    """Attention over a sliding window of 64 saves n·min(n, 64) (here 1 KiB each): the chord
    between 48 and 80 is 10% below it at 64. Where a profiled size shows the bend, nothing is
    predicted; sizes rounded up to a GPU allocator's 512 bytes are no bend."""
    from solvers.predict import predict_chain

    def profiled(saved, sizes: tuple[int, ...]) -> list[tuple[int, Chain]]:
        stages = [Stage("s", 1e-3, 2e-3, out_bytes=n, saved_bytes=saved(n)) for n in sizes]
        return [(n, Chain("c", 1000, (stage,))) for n, stage in zip(sizes, stages, strict=True)]

    def banded(n: int) -> int:
        return 1024 * n * min(n, 64)

    assert predict_chain(profiled(banded, (32, 48, 80, 96)), 64) is None  # 80: above 48-96's
    assert predict_chain(profiled(banded, (16, 32, 48)), 40) is not None  # convex: above
    two = predict_chain(profiled(banded, (48, 80)), 64)  # two sizes cannot show the bend
    assert two is not None and two.stages[0].saved_bytes < banded(64)

    def rounded(n: int) -> int:  # four tensors linear in n, each rounded up to 512 bytes
        return sum(-(-c * n // 512) * 512 for c in (4, 8, 1536, 12288))

    assert predict_chain(profiled(rounded, (60, 97, 211)), 130) is not None


def test_bytes_are_taken_for_a_quadratic_only_where_four_sizes_show_one() -> None:
    from solvers.predict import predict_chain

    three, four = _growing(2, (16, 32, 64)), _growing(2, (16, 32, 48, 64))
    assert predict_chain(three, 24).stages[0].saved_bytes > 2 * 24 * 24  # the chord, above
    assert predict_chain(four, 24).stages[0].saved_bytes == 2 * 24 * 24  # exact
    # Beyond the profiled sizes no chord bounds the bytes: predicted from a shown quadratic only.
    assert predict_chain(three, 70) is None
    assert predict_chain(four, 70).stages[0].saved_bytes == 2 * 70 * 70
    assert predict_chain(_growing(3, (16, 32, 48, 64)), 70) is None


class TriangleAttention(nn.Module):
    """Saves a [batch, n, n, n] softmax, as the triangle attention of AlphaFold's Evoformer."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.out = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.query(x)[..., 0]
        logits = q[:, :, None, None] * q[:, None, :, None] + q[:, None, None, :]
        weights = logits.softmax(-1).mean(-1).mean(-1)
        return x + self.out(x * weights[..., None])


def test_a_length_predicted_for_bytes_growing_as_its_cube_stays_within_the_budget() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[TriangleAttention() for _ in range(10)])
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(2, n, 4, generator=generator), torch.randn(2, n, 4, generator=generator)

    # 0.86 of keep-all's peak at length 11. Length 32 does not fit, but is profiled.
    om = offremat.optimize(model, batch(16)[0], budget=120_000)
    with pytest.raises(offremat.InfeasibleBudgetError):
        om(batch(32)[0])
    for n in (8, 11):
        check_step(om, model, reference, *batch(n))
    # A quadratic through 8, 16 and 32 comes out 24% low at 11, and planned over the budget.
    assert om.chain.metadata.get("predicted_from") == [8.0, 16.0, 32.0]


def test_a_shape_near_profiled_ones_is_planned_on_a_predicted_chain() -> None:
    model = mlp()
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(2)
    # Room for profiling 320 rows inside the measured step (a stage run as plain autograd).
    om = offremat.optimize(model, torch.randn(64, 64), budget=2_300_000)
    sources = {}
    # 240 lies between two profiled sizes, near one: predicted. 128 lies too far from both
    # (a time could be 25% off): profiled. 192 lies between three: predicted. 32 lies below
    # them, where three sizes do not bound the bytes: profiled. Four sizes show the bytes
    # linear (a quadratic), so 8, below them by less than a quarter of their span, and 288,
    # above them by as little, are predicted. 320 lies too far above: profiled.
    for rows in (256, 240, 128, 192, 32, 8, 288, 320):
        x = torch.randn(rows, 64, generator=generator)
        check_step(om, model, reference, x, torch.randn(rows, 64, generator=generator))
        sources[rows] = om.chain.metadata.get("predicted_from")
    assert sources == {
        256: None,
        240: [64.0, 256.0],
        128: None,
        192: [64.0, 128.0, 256.0],
        32: None,
        8: [32.0, 64.0, 128.0, 256.0],
        288: [32.0, 64.0, 128.0, 256.0],
        320: None,
    }
    assert om.cache_info()["predicted"] == 4


def _profiles(model_name: str, sizes: tuple[int, ...]) -> dict[int, Chain]:
    """Real profiles of the in-repo GPT (by sequence length) or ResNet (by batch size)."""
    from offremat import models
    from offremat.profiler import profile_model

    if model_name == "gpt":
        config = models.GPTConfig(layers=2, hidden=64, heads=4, seq=256, vocab=128, dropout=0.0)
        model = models.build_gpt(config)

        def batch(n):
            return models.gpt_batch(models.GPTConfig(**{**config.__dict__, "seq": n}), 4)

    else:
        config = models.ResNetConfig(blocks=(1, 1), width=8, image=16)
        model = models.build_resnet(config)

        def batch(n):
            return models.resnet_batch(config, n)

    return {n: profile_model(model, batch(n), warmup=1, repeats=1) for n in sizes}


@pytest.mark.parametrize(
    ("model_name", "sizes", "unseen"),
    [
        ("gpt", (96, 256), 128),  # between two: the lower of two upper bounds
        ("gpt", (64, 128, 256), 96),  # between three: times a quadratic, bytes a chord
        ("gpt", (64, 96, 128, 256), 32),  # below four
        ("resnet", (16, 32), 24),
        ("resnet", (8, 12, 16, 24), 28),  # above four
        ("resnet", (16, 20, 24, 32), 12),  # below four
    ],
)
def test_predicted_bytes_match_a_real_profile_of_the_same_shape(model_name, sizes, unseen):
    from solvers.predict import predict_chain

    # Bytes only: times are measurements, compared in experiments/shape_prediction.py.
    chains = _profiles(model_name, (*sizes, unseen))
    real = chains.pop(unseen)
    predicted = predict_chain(list(chains.items()), unseen)
    assert predicted is not None
    for field in ("input_bytes", "held_bytes"):
        assert getattr(predicted, field) == pytest.approx(getattr(real, field), rel=0.1)
    for guess, truth in zip(predicted.stages, real.stages, strict=True):
        for field in ("out_bytes", "saved_bytes", "grad_bytes", "bwd_tmp_bytes"):
            assert getattr(guess, field) == pytest.approx(getattr(truth, field), rel=0.1, abs=64)


def _chain_of(times: list[float], size: float) -> Chain:
    """A two-stage chain whose stage times are ``times`` and whose bytes scale with ``size``."""
    stages = tuple(
        Stage(
            name=f"s{k}", fwd_s=t, bwd_s=2 * t, out_bytes=int(8 * size), saved_bytes=int(16 * size)
        )
        for k, t in enumerate(times)
    )
    return Chain(name="synthetic", input_bytes=int(4 * size), stages=stages)


def test_between_two_sizes_a_time_is_bounded_from_above_and_far_sizes_are_profiled() -> None:
    from solvers.predict import TIME_ERROR, predict_chain

    # Stage 0 costs c + a·n (the chord is exact), stage 1 a·n + b·n² (the origin fit is).
    def costs(n: float) -> list[float]:
        return [1e-3 + 2e-5 * n, 1e-5 * n + 4e-8 * n * n]

    profiled = [(n, _chain_of(costs(n), n)) for n in (96.0, 192.0)]
    predicted = predict_chain(profiled, 128.0)
    assert predicted is not None
    for stage, truth in zip(predicted.stages, costs(128.0), strict=True):
        assert stage.fwd_s == pytest.approx(truth, rel=1e-9)
        assert stage.bwd_s == pytest.approx(2 * truth, rel=1e-9)
    assert predicted.stages[0].saved_bytes == 16 * 128
    # The worst time, c + b·n² with b·n1·n2 = c: 128 from 96 and 256 is at the bound.
    worst = [(n, _chain_of([1e-3 * (1 + n * n / (96 * 256))] * 2, n)) for n in (96.0, 256.0)]
    predicted = predict_chain(worst, 128.0)
    assert predicted is not None
    truth = _chain_of([1e-3 * (1 + 128 * 128 / (96 * 256))] * 2, 128.0).compute_time_s
    assert predicted.compute_time_s == pytest.approx((1 + TIME_ERROR) * truth, rel=1e-9)
    assert predict_chain(worst, 140.0) is None  # 11.6% at worst: profiled
    linear = [(n, _chain_of([1e-5 * n, 3e-5 * n], n)) for n in (64.0, 256.0)]
    assert predict_chain(linear, 128.0) is None  # 25% at worst
    assert predict_chain(linear, 250.0) is not None  # 1.4%


def test_the_predictor_declines_shapes_far_from_profiled_ones() -> None:
    from solvers.predict import predict_chain

    chains = _profiles("resnet", (8, 16, 24, 32))
    two = [(8, chains[8]), (32, chains[32])]
    four = list(chains.items())
    assert predict_chain(two[:1], 16) is None  # one size: nothing to fit
    assert predict_chain(two, 4) is None and predict_chain(two, 36) is None  # outside two
    assert predict_chain(four[1:], 38) is None  # above three: their bytes not shown quadratic
    assert predict_chain(four, 1) is None  # below reach
    assert predict_chain(four, 2) is not None
    assert predict_chain(four, 39) is None  # above reach
    assert predict_chain(four, 38) is not None


def test_with_the_milp_a_new_shape_runs_on_the_dps_plan_then_on_the_milps(tmp_path) -> None:
    model = mlp()
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(3)
    om = offremat.optimize(
        model,
        torch.randn(64, 64),
        budget=2_000_000,
        solver="milp",
        bandwidth=1e12,  # copies cost next to nothing: the MILP offloads, the DP recomputes
        cache_dir=tmp_path,
    )
    plans, files = [], []
    for rows in (64, 128, 128, 128):
        x = torch.randn(rows, 64, generator=generator)
        check_step(om, model, reference, x, torch.randn(rows, 64, generator=generator))
        plans.append(om.plan)
        files.append(len(list(tmp_path.glob("*.json"))))
    # Which solver's plan a step runs on depends on the order of shapes only, never on timing.
    assert [plan.solver for plan in plans] == ["milp", "dp", "milp", "milp"]
    assert files == [1, 1, 2, 2]  # the disk keeps the MILP's plans, not the DP's stand-in
    dp, milp = plans[1], plans[2]
    assert "recompute" in dp.decisions.values() and "recompute" not in milp.decisions.values()
    assert milp.predicted_time_s < dp.predicted_time_s
    assert plans[3] is milp  # improved once, then reused
    assert om.cache_info()["improved"] == 1


def test_with_the_milp_a_shape_the_quick_dp_cannot_plan_gets_the_milps_plan_at_once(
    monkeypatch,
) -> None:
    # Since the DP reaches rotor's exact least memory, only offloading could fit where it
    # does not, and on these chains offloading gains no byte of least memory: the DP's
    # refusal is forced.
    def refusing(plan, solver, options):
        def quick(chain):
            raise offremat.InfeasibleBudgetError(plan.budget_bytes, 10**9, "dp")

        return quick

    monkeypatch.setattr("offremat._planning._quick_for", refusing)
    model = mlp()
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(4)
    om = offremat.optimize(
        model, torch.randn(64, 64), budget=1_745_000, solver="milp", bandwidth=1e12
    )
    x = torch.randn(384, 64, generator=generator)
    # Profiling 384 rows takes more than the budget, so the step that plans is not measured.
    step(om, x, torch.zeros(384, 64))
    check_step(om, model, reference, x, torch.randn(384, 64, generator=generator))
    assert om.plan.solver == "milp"
    assert om.cache_info()["improved"] == 0


def test_an_input_that_now_requires_grad_is_named_so_when_refused() -> None:
    """A frozen prefix needs no backward until the input requires grad: that input gets a
    plan of its own, and a refusal names what changed, not only the example's own shape."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 32)) for _ in range(6)]
    for block in blocks[:5]:
        block.requires_grad_(False)
    x = torch.randn(64, 32)
    om = offremat.optimize(nn.Sequential(*blocks), x, budget=1.0)
    with pytest.raises(offremat.InfeasibleBudgetError, match=r"\(64, 32\) float32 requiring grad"):
        om(x.clone().requires_grad_())


HEADS = 1  # read by GlobalHeadsBlock's forward: the plan cache's key does not see its value


class GlobalHeadsBlock(nn.Module):
    """Attention whose head count is a global of its module: its saved scores grow with it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2) / 4).softmax(-1)
        return x + (scores @ v).transpose(1, 2).reshape(b, t, c)


def global_heads_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[GlobalHeadsBlock() for _ in range(6)])


def test_a_cached_plan_is_measured_once_though_every_step_makes_its_gradients(tmp_path) -> None:
    """A loop that sets .grad to None (zero_grad's default) makes the gradients in every
    step, and the budget leaves them out: the first step's check measures without them, and
    the steps after it run unmeasured (each step was measured, slowed by the tracker)."""
    x = torch.randn(4, 32, 32)
    budget = offremat.optimize(global_heads_model(), x, budget=0.6).plan.budget_bytes
    offremat.optimize(global_heads_model(), x, budget=budget, cache_dir=tmp_path)
    model = global_heads_model()
    om = offremat.optimize(model, x, budget=budget, cache_dir=tmp_path)
    measured = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        om(x).sum().backward()
        measured.append(om.stats.measured_peak_bytes)
    assert measured[0] > budget  # with the gradients it made
    assert measured[1:] == [None, None]
    assert om.cache_info()["misses"] == 0  # it fits: not profiled again


def test_a_cached_plan_measured_over_its_budget_is_profiled_again(tmp_path, monkeypatch) -> None:
    """The key cannot see every setting (a module global here). A plan read from disk has its
    first step measured; over its budget, its shape is profiled at the next step."""

    x = torch.randn(4, 32, 32)
    budget = offremat.optimize(global_heads_model(), x, budget=0.6).plan.budget_bytes
    offremat.optimize(global_heads_model(), x, budget=budget, cache_dir=tmp_path)
    # A plan read from disk that fits is kept, though its first step makes the gradients (over
    # the budget only with them, that step leaves the check to the next, which passes it).
    fresh = offremat.optimize(global_heads_model(), x, budget=budget, cache_dir=tmp_path)
    for _ in range(3):
        fresh(x).sum().backward()
    assert fresh.cache_info()["misses"] == 0 and fresh.stats.measured_peak_bytes is None
    monkeypatch.setitem(globals(), "HEADS", 8)  # as if the file had been edited
    for switched in (False, True):
        om = offremat.optimize(global_heads_model(), x, budget=budget, cache_dir=tmp_path)
        assert om.cache_info()["from_disk"] == 1
        om(x).sum().backward()
        assert om.stats.measured_peak_bytes > budget  # the stale plan's step, measured
        if switched:  # a step in another state keeps the verdict of this one
            om.eval()
            with pytest.raises(offremat.InfeasibleBudgetError):
                om(x)
            om.train()
        with pytest.raises(offremat.InfeasibleBudgetError):  # profiled at 8 heads: no fit
            om(x)


def test_a_stale_keep_all_plan_read_from_disk_is_measured_and_profiled_again(
    tmp_path, monkeypatch
) -> None:
    """A keep-all plan runs as plain autograd, and its first step's forward is measured: a
    stale one (2.7 times its budget at every step, unseen) is planned again at the next."""

    x = torch.randn(4, 32, 32)
    budget = offremat.optimize(global_heads_model(), x, budget=1.0).plan.budget_bytes
    offremat.optimize(global_heads_model(), x, budget=budget, cache_dir=tmp_path)
    monkeypatch.setitem(globals(), "HEADS", 8)  # four times the scores, as if edited
    model = global_heads_model()
    om = offremat.optimize(model, x, budget=budget, cache_dir=tmp_path)
    assert om.cache_info()["from_disk"] == 1
    assert set(om.plan.decisions.values()) == {"keep"}
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    om(x).sum().backward()  # the stale plan's step
    with StepMemory("cpu", inputs=x) as memory:
        om(x).sum().backward()
    assert om.cache_info()["misses"] == 1  # profiled at 8 heads and planned again
    assert "recompute" in om.plan.decisions.values()
    assert memory.peak_bytes <= budget


class SlidingWindowBlock(nn.Module):
    """Attention over the last 16 positions, materialised as a band: it saves n·min(n, 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        w = min(x.shape[1], 16)
        keys = F.pad(k, (0, 0, w - 1, 0)).unfold(1, w, 1)
        values = F.pad(v, (0, 0, w - 1, 0)).unfold(1, w, 1)
        weights = torch.einsum("bnd,bndw->bnw", q, keys).softmax(-1)
        return x + self.out(torch.einsum("bnw,bndw->bnd", weights, values))


def test_a_length_predicted_under_its_bytes_is_measured_then_profiled() -> None:
    """Lengths 12 and 20 straddle the window's bend: 16, predicted between them, is
    underestimated, and its first step passes the budget. It is measured, and the shape is
    profiled and planned for its next step, which fits."""
    torch.manual_seed(0)
    model = nn.Sequential(*[SlidingWindowBlock() for _ in range(8)])
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    om = offremat.optimize(model, torch.randn(8, 12, 16), budget=0.5)
    om(torch.randn(8, 20, 16)).sum().backward()  # profiled
    steps = []
    for _ in range(2):
        x = torch.randn(8, 16, 16)
        with StepMemory("cpu", inputs=x) as memory:
            om(x).sum().backward()
        steps.append(memory.peak_bytes)
    assert om.cache_info()["predicted"] == 1
    assert steps[0] > om.plan.budget_bytes >= steps[1]


def test_a_keep_all_plan_read_from_disk_runs_as_plain_autograd(tmp_path) -> None:
    """A keep-all plan is plain autograd's schedule, read from disk or not: a second backward
    with retain_graph=True runs, as plain autograd's does."""
    x = torch.randn(4, 32, 32)
    for _ in range(2):  # made and stored, then read back
        torch.manual_seed(0)
        model = nn.Sequential(*[GlobalHeadsBlock() for _ in range(3)])
        om = offremat.optimize(model, x, budget=1.0, cache_dir=tmp_path)
    assert om.cache_info()["from_disk"] == 1
    loss = om(x).sum()
    loss.backward(retain_graph=True)
    loss.backward()


class NormedConvBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.norm(self.conv(x)))


def test_a_new_shape_planned_while_a_forward_awaits_its_backward_leaves_its_graph_valid() -> None:
    # Two crops of different sizes through a BatchNorm network, one backward (SimCLR's
    # multi-crop): planning the second shape runs the model to profile it, and putting the
    # running statistics back must not look like an in-place change to the first forward's
    # graph, which saved them.
    torch.manual_seed(0)
    reference = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), *[NormedConvBlock(16) for _ in range(6)]
    )
    model = copy.deepcopy(reference)
    large, small = torch.randn(8, 3, 24, 24), torch.randn(8, 3, 16, 16)
    # Room for the second shape's plan beside the first forward's held bytes (with the
    # convolutions' own scratch counted, 0.5 leaves none).
    om = offremat.optimize(model, large, budget=0.6)
    for net in (reference, om):
        (net(large).square().mean() + net(small).square().mean()).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    for a, b in zip(model.buffers(), reference.buffers(), strict=True):
        assert torch.equal(a, b)


def test_a_signature_names_the_values_it_keeps() -> None:
    from offremat._signatures import describe, input_signature

    batch = {"x": torch.zeros(2, 3), "k": 3, "task": "sum", "scale": 0.5, "flag": True}
    assert describe(input_signature(batch)) == "(2, 3) float32 with k=3, task='sum', scale=0.5"
    assert describe(input_signature((torch.zeros(2), 7))) == "(2,) float32 with 7"
    # An object as its repr, unquoted; a long string cut (a review).
    caption = "a caption " * 30
    described = describe(input_signature({"x": torch.zeros(2), "c": caption, "e": ...}))
    assert described == "(2,) float32 with c='a caption a caption a caption a capt..., e=Ellipsis"
