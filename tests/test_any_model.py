"""Models as their users have them: Hugging Face decoders and ViT, a torchvision-style ResNet
and a user's own residual module, optimized unchanged. The oracles are plain autograd (loss,
gradients, BatchNorm statistics, bit for bit) and the independent memory tracker."""

from __future__ import annotations

import copy
import io
import logging
import pickle

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offremat
from offremat.measure import StepMemory
from tests import model_zoo as zoo

pytest.importorskip("transformers")

IDS = torch.randint(0, 96, (4, 64), generator=torch.Generator().manual_seed(0))
LM_BATCH = {"input_ids": IDS, "labels": IDS}
IMAGES = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1))
CLASSES = torch.tensor([1, 2, 3, 4])
FEATURES = torch.randn(32, 16, 16, generator=torch.Generator().manual_seed(2))
TARGETS = torch.randn(32, 16, 4, generator=torch.Generator().manual_seed(3))

# name: (builder, batch, target for a loss outside the model or None, budget fractions).
# A torchvision ResNet's stem needs about half of keep-all on its own (its least feasible
# budget is 48% of keep-all here), so it is planned at 50% and 70%.
MODELS = {
    "gpt2": (zoo.gpt2, LM_BATCH, None, (0.3, 0.5)),
    "llama": (zoo.llama, LM_BATCH, None, (0.3, 0.5)),
    "qwen2": (zoo.qwen2, LM_BATCH, None, (0.3, 0.5)),
    "vit": (zoo.vit, {"pixel_values": IMAGES[:, :, :32, :32], "labels": CLASSES}, None, (0.3, 0.5)),
    "resnet": (lambda: zoo.ResNet(depths=(6, 2, 2, 2)), IMAGES, CLASSES, (0.5, 0.7)),
    "residual": (zoo.ResidualNet, FEATURES, TARGETS, (0.3, 0.5)),
}


def loss_of(model, batch, target) -> torch.Tensor:
    """One forward as each model's users write it, with the same random numbers each time."""
    torch.manual_seed(7)
    if target is None:
        return model(**batch).loss
    output = model(batch)
    if target.dtype == torch.long:
        return F.cross_entropy(output, target)
    return F.mse_loss(output, target)


@pytest.fixture(scope="module", params=sorted(MODELS))
def profiled(request):
    builder, batch, target, fractions = MODELS[request.param]
    torch.manual_seed(0)
    model = builder().train()
    chain = offremat.optimize(copy.deepcopy(model), batch, budget=1.0).chain
    return request.param, model, chain, batch, target, fractions


@pytest.mark.parametrize("solver", ["dp", "milp"])
def test_plans_train_exactly_and_fit_in_measured_memory(profiled, solver) -> None:
    name, model, chain, batch, target, fractions = profiled
    options = {"bandwidth": "2GB/s", "time_limit_s": 20.0} if solver == "milp" else {}
    for fraction in fractions:
        reference, optimized = copy.deepcopy(model), copy.deepcopy(model)
        om = offremat.optimize(
            optimized, batch, budget=fraction, solver=solver, chain=chain, **options
        )
        for parameter in (*optimized.parameters(), *reference.parameters()):
            parameter.grad = torch.zeros_like(parameter)  # as in every step after the first
        with StepMemory("cpu", inputs=(batch, target)) as memory:
            loss = loss_of(om, batch, target)
            loss.backward()
            loss = loss.detach()
        expected = loss_of(reference, batch, target)
        expected.backward()
        assert torch.equal(loss, expected.detach()), name
        for (key, p), q in zip(optimized.named_parameters(), reference.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), f"{name} {solver} {fraction}: {key}"
        for a, b in zip(optimized.buffers(), reference.buffers(), strict=True):
            assert torch.equal(a, b), f"{name}: a buffer (BatchNorm statistics) differs"
        predicted = om.plan.predicted_peak_bytes
        assert memory.peak_bytes <= om.plan.budget_bytes, (name, solver, fraction)
        assert abs(memory.peak_bytes - predicted) <= 0.1 * predicted, (name, solver, fraction)


def test_training_generation_and_training_again_follow_plain_autograd() -> None:
    torch.manual_seed(0)
    model = zoo.gpt2().train()
    reference = copy.deepcopy(model)
    om = offremat.optimize(model, LM_BATCH, budget=0.4)
    losses = {}
    for name, network in (("offremat", om), ("plain", reference)):
        optimizer = torch.optim.AdamW(network.parameters(), lr=1e-3)
        trace = []
        for phase in ("train", "generate", "train"):
            if phase == "generate":
                network.eval()
                with torch.no_grad():
                    trace.append(network.generate(IDS[:1, :8], max_new_tokens=4, do_sample=False))
                network.train()
                continue
            for _ in range(3):
                optimizer.zero_grad()
                loss = loss_of(network, LM_BATCH, None)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(network.parameters(), 0.5)
                optimizer.step()
                trace.append(loss.detach())
        losses[name] = trace
    for ours, theirs in zip(losses["offremat"], losses["plain"], strict=True):
        assert torch.equal(ours, theirs)


def test_the_wrapped_model_saves_under_its_own_keys(tmp_path) -> None:
    torch.manual_seed(0)
    model = zoo.llama().train()
    om = offremat.optimize(model, LM_BATCH, budget=0.5)
    assert list(om.state_dict()) == list(model.state_dict())
    om.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    reloaded_state = reloaded.state_dict()
    assert list(reloaded_state) == list(model.state_dict())
    for (key, a), b in zip(model.state_dict().items(), reloaded_state.values(), strict=True):
        assert torch.equal(a, b), key
    assert om.config is model.config


def test_blocks_can_be_named_and_bad_names_say_what_to_name() -> None:
    torch.manual_seed(0)
    model = zoo.ResidualNet().train()
    om = offremat.optimize(model, FEATURES, budget=0.5, blocks="blocks")
    assert om.chain.metadata["blocks"] == [f"blocks.{k}" for k in range(6)]
    with pytest.raises(offremat.NotAChainError, match=r"has no submodule 'nope'.*blocks"):
        offremat.optimize(model, FEATURES, budget=0.5, blocks="nope")
    with pytest.raises(offremat.NotAChainError, match="is a Linear; name a ModuleList"):
        offremat.optimize(model, FEATURES, budget=0.5, blocks="head")


def test_every_block_output_is_refused_rather_than_faked() -> None:
    torch.manual_seed(0)
    model = zoo.gpt2().train()
    om = offremat.optimize(model, LM_BATCH, budget=0.5)
    with pytest.raises(offremat.NotAChainError, match="output_hidden_states=True"):
        om(**LM_BATCH, output_hidden_states=True)


def test_in_place_check_looks_at_stages_after_grouping() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.ReLU(inplace=True),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(inplace=True),
        torch.nn.Linear(32, 4),
    )
    x = torch.randn(16, 8)
    with pytest.raises(RuntimeError, match="in place"):
        offremat.optimize(model, x, budget=1.0)
    om = offremat.optimize(model, x, budget=1.0, stages=2)
    reference = copy.deepcopy(model)
    om(x).sum().backward()
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_cli_profiles_a_users_own_model_from_its_file(tmp_path) -> None:
    from offremat.cli import main
    from solvers.chain import Chain

    (tmp_path / "blocks.py").write_text(
        "from torch import nn\n"
        "class Block(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.linear = nn.Linear(8, 8)\n"
        "    def forward(self, h, mask):\n"
        "        return h + self.linear(h) * mask\n"
    )
    (tmp_path / "net.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "from blocks import Block\n"  # a sibling, imported as Python would
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layers = nn.ModuleList(Block() for _ in range(3))\n"
        "        self.head = nn.Linear(8, 1)\n"
        "    def forward(self, x, mask):\n"
        "        for layer in self.layers:\n"
        "            x = layer(x, mask)\n"
        "        return self.head(x)\n"
        "def build(batch_size=4):\n"
        "    return Net(), (torch.randn(batch_size, 8), torch.ones(batch_size, 1))\n"
    )
    out = tmp_path / "chain.json"
    argv = ["profile", f"{tmp_path / 'net.py'}:build", "--out", str(out), "--repeats", "1"]
    assert main(argv) == 0
    chain = Chain.load(out)
    assert chain.stage_names == ("layers.0", "layers.1", "layers.2")
    assert chain.metadata["blocks"] == ["layers.0", "layers.1", "layers.2"]


def test_blocks_that_take_only_the_state_bring_their_stem_and_head() -> None:
    torch.manual_seed(0)
    model = zoo.StateOnlyNet().train()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16, 16)
    target = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    om = offremat.optimize(model, x, budget=0.5)
    assert om.chain.metadata["blocks"][0] == "stem"
    assert om.chain.metadata["blocks"][-1] == "head"
    for network in (model, reference):
        for parameter in network.parameters():
            parameter.grad = torch.zeros_like(parameter)
    with StepMemory("cpu", inputs=(x, target)) as memory:
        loss_of(om, x, target).backward()
    loss_of(reference, x, target).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert memory.peak_bytes <= om.plan.budget_bytes


class ReturnsItsFeatures(zoo.StateOnlyNet):
    """Returns the last block's output (the features) beside the logits, or the stem's."""

    def __init__(self, returned: str):
        super().__init__()
        self.returned = returned

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stem = h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h), h if self.returned == "features" else stem


@pytest.mark.parametrize(
    ("returned", "first", "last"), [("features", "stem", "blocks.5"), ("stem", "blocks.0", "head")]
)
def test_a_stage_output_the_model_also_returns_ends_or_starts_the_chain(
    returned, first, last
) -> None:
    # The head (or the stem) joins a run of blocks that take only the state, unless the model
    # returns the state it takes: then that state is no intermediate of the chain.
    torch.manual_seed(0)
    model = ReturnsItsFeatures(returned).train()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16, 16)
    target = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    om = offremat.optimize(model, x, budget=0.6)
    assert om.chain.metadata["blocks"][0] == first
    assert om.chain.metadata["blocks"][-1] == last
    for network in (model, reference):
        for parameter in network.parameters():
            parameter.grad = torch.zeros_like(parameter)
    with StepMemory("cpu", inputs=(x, target)) as memory:
        logits, features = om(x)
        (F.cross_entropy(logits, target) + features.sum()).backward()
    logits, features = reference(x)
    (F.cross_entropy(logits, target) + features.sum()).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        if returned == "features":
            assert torch.equal(p.grad, q.grad)
        else:  # the chain's input is used after it too: summed in another order (README)
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    assert memory.peak_bytes <= om.plan.budget_bytes


def test_an_intermediate_block_output_used_elsewhere_is_an_error_not_a_wrong_loss() -> None:
    torch.manual_seed(0)
    model = zoo.KeepsAnIntermediate().train()
    om = offremat.optimize(model, FEATURES, budget=0.6)
    output = om(FEATURES)
    with pytest.raises(RuntimeError, match=r"blocks\.2's output for more than"):
        (output.sum() + model.middle.sum()).backward()


def test_a_model_list_of_blocks_still_profiles_as_a_list(tmp_path) -> None:
    from offremat.cli import main

    (tmp_path / "lists.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "def build(batch_size=4):\n"
        "    blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))\n"
        "    return blocks, torch.randn(batch_size, 8)\n"
    )
    out = tmp_path / "chain.json"
    argv = ["profile", f"{tmp_path / 'lists.py'}:build", "--out", str(out), "--repeats", "1"]
    assert main(argv) == 0
    assert main([*argv, "--blocks", "x"]) == 2


def test_the_container_the_error_suggests_is_the_one_that_works() -> None:
    """Block paths are the model's own (named_modules): a Llama's layers are model.layers."""
    torch.manual_seed(0)
    model = zoo.llama().train()
    om = offremat.optimize(model, LM_BATCH, budget=0.5, blocks="model.layers")
    assert om.chain.stage_names[0] == "model.layers.0"
    with pytest.raises(offremat.NotAChainError, match=r"such as \['model.layers'\]"):
        offremat.optimize(model, LM_BATCH, budget=0.5, blocks="layers")


def test_outputs_equal_up_to_rounding_are_told_apart_from_another_model() -> None:
    from offremat._model_chain import _rounding_difference

    a = torch.linspace(-3, 3, 64)
    assert _rounding_difference([a], [a.clone()]) == 0.0
    close = a + 6e-8
    assert _rounding_difference([a], [close]) == pytest.approx((close - a).abs().max().item())
    assert _rounding_difference([a], [a * 1.1]) is None  # another computation
    assert _rounding_difference([a], [a[:32]]) is None
    assert _rounding_difference([a], [a, a]) is None
    ints = torch.arange(4)
    assert _rounding_difference([ints], [ints + 1]) is None


class _Looped(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        blocks = (torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(4))
        self.blocks = torch.nn.ModuleList(blocks)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def test_a_full_backward_hook_on_a_found_block_is_refused_naming_the_hook() -> None:
    torch.manual_seed(0)
    model, x = _Looped(), torch.randn(8, 16)
    handle = model.blocks[1].register_full_backward_pre_hook(lambda module, grad: None)
    with pytest.raises(offremat.NotAChainError, match=r"blocks\.1 has a backward hook"):
        offremat.optimize(model, x, budget=1.0, solver="checkpoint-every-stage")
    handle.remove()
    om = offremat.optimize(model, x, budget=1.0, solver="checkpoint-every-stage")
    model.blocks[2].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    with pytest.raises(offremat.NotAChainError, match=r"blocks\.2 has a backward hook"):
        om(x)


class _DrawsBetweenBlocks(_Looped):
    """Draws a random number between block calls (logged): the blocks' dropout then takes
    other random numbers when the chain runs them one after the other."""

    def __init__(self) -> None:
        super().__init__()
        for block in self.blocks:
            block.append(torch.nn.Dropout(0.2))
        self.drawn: list[float] = []

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            self.drawn.append(torch.rand(()).item())
        return self.head(x).pow(2).mean()


def test_random_numbers_drawn_between_blocks_are_named_in_the_refusal() -> None:
    torch.manual_seed(0)
    with pytest.raises(offremat.NotAChainError, match="draws between their calls"):
        offremat.optimize(_DrawsBetweenBlocks(), torch.randn(8, 16), budget=1.0)


class _AuxBlock(torch.nn.Module):
    def __init__(self, aux: bool) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.aux = aux

    def forward(self, x, scale=1.0):
        h = torch.tanh(self.linear(x)) * scale
        return (h, h.pow(2).mean()) if self.aux else h


class _AuxModel(torch.nn.Module):
    """MoE-style blocks that return an auxiliary loss, or take a per-layer argument."""

    def __init__(self, per_layer: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_AuxBlock(not per_layer) for _ in range(3))
        self.per_layer = per_layer

    def forward(self, x):
        total = 0.0
        for n, block in enumerate(self.blocks):
            if self.per_layer:
                x = block(x, scale=float(n + 1))
            else:
                x, aux = block(x)
                total = total + aux
        return x.pow(2).mean() + total


class _Parallel(_AuxModel):
    """Blocks that each take the model's input: no chain."""

    def __init__(self) -> None:
        super().__init__(per_layer=True)

    def forward(self, x):
        return sum(block(x) for block in self.blocks).pow(2).mean()


def test_a_named_container_that_is_no_chain_says_what_breaks_it() -> None:
    model, x = _Parallel(), torch.randn(8, 16)
    with pytest.raises(offremat.NotAChainError, match="the error then says what breaks"):
        offremat.optimize(model, x, budget=1.0)
    with pytest.raises(offremat.NotAChainError, match=r"does not take blocks\.0's output"):
        offremat.optimize(model, x, budget=1.0, blocks="blocks")


@pytest.mark.parametrize("blocks", [None, "blocks"])
def test_blocks_each_taking_a_number_of_their_own_train_as_plain_autograd(blocks) -> None:
    """Refused before (a chain's blocks took the same side arguments): each block's scale is
    a side input of its own, and the chain runs at the last block's call."""
    torch.manual_seed(0)
    model, x = _AuxModel(per_layer=True), torch.randn(8, 16)
    reference = copy.deepcopy(model)
    om = offremat.optimize(model, x, budget=0.8, blocks=blocks)
    assert om.chain.metadata["blocks"] == ["blocks.0", "blocks.1", "blocks.2"]
    assert "recompute" in om.plan.decisions.values()
    loss = om(x)
    loss.backward()
    expected = reference(x)
    expected.backward()
    assert torch.equal(loss, expected)
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    assert all(torch.equal(p.grad, q.grad) for p, q in pairs)


@pytest.mark.parametrize("blocks", [None, "blocks"])
def test_an_auxiliary_loss_a_block_returns_is_refused_when_the_model_reads_it(blocks) -> None:
    # The chain hands on hidden states alone: a loss term summed outside the blocks would
    # be lost, so its first use by the model is refused.
    model, x = _AuxModel(per_layer=False), torch.randn(8, 16)
    with pytest.raises(offremat.NotAChainError, match=r"output 2 of the 2 tensors blocks\.0"):
        offremat.optimize(model, x, budget=1.0, blocks=blocks)


class _StackedAuxModel(_AuxModel):
    """Auxiliary losses gathered in a list and stacked: the stand-in sits inside an argument."""

    def __init__(self) -> None:
        super().__init__(per_layer=False)

    def forward(self, x):
        losses = []
        for block in self.blocks:
            x, aux = block(x)
            losses.append(aux)
        return x.pow(2).mean() + torch.stack(losses).sum()


def test_a_dropped_output_used_inside_a_list_is_refused_by_name() -> None:
    # Raised a bare StopIteration, which map() would have taken for its end.
    with pytest.raises(offremat.NotAChainError, match=r"blocks\.0 returns \(stack\)"):
        offremat.optimize(_StackedAuxModel(), torch.randn(8, 16), budget=1.0)


class _LastBlockElsewhere(_AuxModel):
    """Blocks of one type, the last called on another tensor than the one before returned
    (as a second tower of the same layers): a chain of the first two."""

    def __init__(self) -> None:
        super().__init__(per_layer=True)

    def forward(self, x):
        for block in self.blocks[:2]:
            x = block(x)
        return self.blocks[2](2.0 * x).pow(2).mean()


def test_a_chain_of_part_of_the_blocks_says_where_the_run_breaks(caplog) -> None:
    with caplog.at_level("WARNING", logger="offremat"):
        om = offremat.optimize(_LastBlockElsewhere(), torch.randn(8, 16), budget=1.0)
    assert [stage.name for stage in om.chain.stages[:2]] == ["blocks.0", "blocks.1"]
    assert "the chain holds 2 of the model's 3 calls of _AuxBlock (blocks.0 .. blocks.1)" in (
        caplog.text
    )
    assert "between blocks.1 and blocks.2, where blocks.2 does not take" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="offremat"):
        offremat.optimize(zoo.ResidualNet(depth=3), torch.randn(8, 16), budget=1.0)
    assert "the chain holds" not in caplog.text


@pytest.mark.parametrize("builder", [zoo.gpt_neo, zoo.bloom, zoo.mpt])
def test_layers_that_also_return_attention_weights_the_model_drops_train_exactly(
    builder,
) -> None:
    # Refused before: the layers return (hidden, attention weights) and the model keeps the
    # first alone. Reading the weights (output_attentions=True) is refused.
    torch.manual_seed(0)
    model = builder().train()
    reference = copy.deepcopy(model)
    om = offremat.optimize(model, LM_BATCH, budget=0.5, solver="dp")
    assert om.chain.length == 4 and "recompute" in om.plan.decisions.values()
    for parameter in (*model.parameters(), *reference.parameters()):
        parameter.grad = torch.zeros_like(parameter)
    with StepMemory("cpu", inputs=LM_BATCH) as memory:
        loss = om(**LM_BATCH).loss
        loss.backward()
    assert memory.peak_bytes <= om.plan.budget_bytes
    plain = reference(**LM_BATCH, use_cache=False).loss
    plain.backward()
    assert torch.equal(loss, plain)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    with pytest.raises(
        offremat.NotAChainError, match="output_attentions=True asks for every block's"
    ):
        om(**LM_BATCH, output_attentions=True)


def test_blocks_that_hand_back_a_side_input_train_exactly(caplog) -> None:
    # T5's blocks take the position bias the first block computes and return it beside their
    # hidden state, and the model hands it to the next block: refused before.
    torch.manual_seed(0)
    model = zoo.t5().train()
    reference = copy.deepcopy(model)
    ids = IDS[:, :16].contiguous()
    batch = {"input_ids": ids, "labels": ids}
    with caplog.at_level("WARNING", logger="offremat"):
        om = offremat.optimize(model, batch, budget=0.9, solver="dp")
    assert om.chain.stage_names[0] == "decoder.block.1" and om.chain.length == 4
    assert "between decoder.block.0 and decoder.block.1" in caplog.text
    assert "recompute" in om.plan.decisions.values()
    for parameter in (*model.parameters(), *reference.parameters()):
        parameter.grad = torch.zeros_like(parameter)
    torch.manual_seed(1)
    with StepMemory("cpu", inputs=batch) as memory:
        loss = om(**batch).loss
        loss.backward()
    assert memory.peak_bytes <= om.plan.budget_bytes
    torch.manual_seed(1)
    plain = reference(**batch).loss
    plain.backward()
    assert torch.equal(loss, plain)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


class _Nesting(torch.nn.Module):
    """A block that may hold a block of its own type (called inside it)."""

    def __init__(self, nested: bool) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.inner = _Nesting(False) if nested else None

    def forward(self, x):
        x = torch.tanh(self.linear(x))
        return x if self.inner is None else self.inner(x)


class _NestingNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Nesting(k == 1) for k in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


class _SequentialsNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(4)]
        )

    def forward(self, x):
        return self.blocks(x).pow(2).mean()


def test_calls_of_the_block_type_inside_or_around_the_blocks_are_not_left_out(caplog) -> None:
    # A block holding one of its own type crashed the warning about calls left out; a
    # Sequential of Sequentials was warned of its container as a call left out.
    with caplog.at_level("WARNING", logger="offremat"):
        om = offremat.optimize(_NestingNet(), torch.randn(8, 16), budget=1.0)
        assert om.chain.stage_names == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
        om = offremat.optimize(_SequentialsNet(), torch.randn(8, 16), budget=1.0)
        assert om.chain.length == 4
    assert "the chain holds" not in caplog.text


class _BiasedBlock(torch.nn.Module):
    """Hands back the bias it takes, as T5's blocks do, beside optional side arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x, mask=None, bias=None, scale=None):
        h = torch.tanh(self.linear(x) + bias)
        h = h if mask is None else h * mask
        return (h if scale is None else h * scale), bias


class _BiasedNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.make_bias = torch.nn.Linear(16, 16)
        self.blocks = torch.nn.ModuleList(_BiasedBlock() for _ in range(4))

    def forward(self, x, mask=None, scale=None):
        bias = self.make_bias(x).detach()
        for block in self.blocks:
            x, bias = block(x, mask=mask, bias=bias, scale=scale)
        return (x + bias).pow(2).mean()


def test_a_side_argument_handed_back_is_found_by_name_whatever_else_is_passed() -> None:
    # Found by its position among the side tensors of the example call, the bias handed back
    # was another tensor when an optional one before it was absent: a wrong loss, silently.
    torch.manual_seed(0)
    model = _BiasedNet()
    reference = copy.deepcopy(model)
    x, mask, scale = torch.randn(64, 16), (torch.rand(64, 16) > 0.3).float(), torch.rand(64, 16)
    om = offremat.optimize(model, {"x": x, "mask": mask}, budget=0.9, solver="dp")
    for call in ({"x": x, "scale": scale}, {"x": x}, {"x": x, "mask": mask, "scale": scale}):
        for parameter in (*model.parameters(), *reference.parameters()):
            parameter.grad = None
        loss, plain = om(**call), reference(**call)
        loss.backward()
        plain.backward()
        assert torch.equal(loss, plain), sorted(call)
        for p, q in zip(model.blocks.parameters(), reference.blocks.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), sorted(call)


class _KeywordStateModel(_AuxModel):
    """Blocks handed their state under a keyword of their own (``block(x=h)``)."""

    def __init__(self) -> None:
        super().__init__(per_layer=True)

    def forward(self, x):
        for block in self.blocks:
            x = block(x=x)
        return x.pow(2).mean()


def test_a_state_handed_under_another_keyword_is_named_with_the_rule() -> None:
    with pytest.raises(offremat.NotAChainError) as refusal:
        offremat.optimize(_KeywordStateModel(), torch.randn(8, 16), budget=1.0, blocks="blocks")
    assert "blocks.1 takes blocks.0's output, but not as its hidden state" in str(refusal.value)
    assert "first positional argument or its hidden_states= keyword" in str(refusal.value)


class _PooledBetween(torch.nn.Module):
    """Blocks with a pooling between their calls, as a U-Net's encoder has."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = torch.nn.functional.max_pool1d(block(x), 1)
        return x.pow(2).mean()


def test_code_between_the_blocks_calls_is_named_with_what_to_do() -> None:
    # The refusal said only that the next block does not take the last one's output (the
    # trial, on a U-Net): what changes it in between belongs in the blocks.
    with pytest.raises(offremat.NotAChainError) as refusal:
        offremat.optimize(_PooledBetween(), torch.randn(8, 16), budget=1.0, blocks="blocks")
    assert "blocks.1 does not take blocks.0's output" in str(refusal.value)
    assert "move that code into the blocks' forward" in str(refusal.value)


class _WideStem(torch.nn.Module):
    """A wide stem, outside the chain, before three narrow blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
        self.down = torch.nn.Linear(256, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3)
        )

    def forward(self, x):
        h = self.down(torch.tanh(self.stem(x)))
        for block in self.blocks:
            h = block(h)
        return h.pow(2).mean()


def test_a_refusal_says_what_the_code_around_the_chain_holds(caplog) -> None:
    # A U-Net planned on its decoder alone was refused at 82% of keep-all, the encoder
    # outside the chain unsaid (the trial).
    with (
        caplog.at_level(logging.WARNING, logger="offremat"),
        pytest.raises(offremat.InfeasibleBudgetError),
    ):
        offremat.optimize(_WideStem(), torch.randn(64, 256), budget=0.3, blocks="blocks")
    assert "the code around the chain (blocks.0 to blocks.2, 3 stages) holds" in caplog.text


class LayerDropNet(torch.nn.Module):
    """Skips each of its blocks at random in training, as LayerDrop does."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(8)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.training and torch.rand(()) < 0.3:
                continue
            x = block(x)
        return x.sum()


def test_blocks_skipped_at_random_are_refused_when_optimized() -> None:
    # Planned, one draw's blocks made the chain, and steps failed later with other messages.
    torch.manual_seed(0)
    with pytest.raises(offremat.NotAChainError, match="ran another sequence of blocks"):
        offremat.optimize(LayerDropNet(), torch.randn(4, 16), budget=0.5)


AUDIO = {"input_values": torch.randn(4, 1600), "labels": torch.tensor([0, 1, 2, 3])}


@pytest.mark.parametrize("seed", [0, 5])
def test_a_hugging_face_layerdrop_is_refused_by_its_setting_whatever_the_draw(seed) -> None:
    # Refused before by whichever check one draw tripped first, three messages, one of
    # which named no random draw.
    model = zoo.wav2vec2(layerdrop=0.1)
    torch.manual_seed(seed)
    with pytest.raises(offremat.NotAChainError, match=r"at random in training \(layerdrop=0.1\)"):
        offremat.optimize(model, AUDIO, budget=0.7)
    model.config.layerdrop = 0.0
    assert offremat.optimize(model, AUDIO, budget=1.0).chain.length == 6


def test_a_layerdrop_setting_leaves_the_models_other_stacks_alone() -> None:
    # The config is the whole model's: the feature encoder's convolutions skip nothing.
    om = offremat.optimize(
        zoo.wav2vec2(layerdrop=0.1),
        AUDIO,
        budget=1.0,
        blocks="wav2vec2.feature_extractor.conv_layers",
    )
    assert om.chain.stage_names[0] == "wav2vec2.feature_extractor.conv_layers.0"


def test_a_model_that_reads_every_blocks_output_is_told_it_has_no_chain() -> None:
    # A weighted sum of the layers' outputs: the advice to name another run with blocks=
    # alone sent the caller looking for one that does not exist.
    model = zoo.wav2vec2(layerdrop=0.0, use_weighted_layer_sum=True)
    with pytest.raises(RuntimeError, match=r"reads every block's output .* has none"):
        offremat.optimize(model, AUDIO, budget=0.7)


class ResidualBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.linear = torch.nn.LayerNorm(32), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(self.norm(x))


class ChangesTheLastOutputInPlace(torch.nn.Module):
    """Applies ReLU in place to the last block's output, as torchvision's DenseNet does."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(16, 32)
        self.blocks = torch.nn.ModuleList(ResidualBlock() for _ in range(6))
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(F.relu(h, inplace=True))


@pytest.mark.parametrize("blocks", [None, "blocks"])
def test_the_last_blocks_output_changed_in_place_after_the_run(blocks) -> None:
    # Discovery took the head for a block of the chain (the in-place op keeps the tensor), and
    # profiling the code after the chain hit autograd's rule on views a function returns.
    torch.manual_seed(0)
    model = ChangesTheLastOutputInPlace()
    reference = copy.deepcopy(model)
    x = torch.randn(64, 16)
    om = offremat.optimize(model, x, budget=0.6, blocks=blocks)
    assert om.chain.stage_names[-1] == "blocks.5"
    for parameter in (*model.parameters(), *reference.parameters()):
        parameter.grad = torch.zeros_like(parameter)
    with StepMemory("cpu", inputs=x) as memory:
        loss = om(x).pow(2).mean()
        loss.backward()
    expected = reference(x).pow(2).mean()
    expected.backward()
    assert torch.equal(loss.detach(), expected.detach())
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)
    assert memory.peak_bytes <= om.plan.budget_bytes


class NoisyExperts(torch.nn.Module):
    """Top-1 gating with noise in training; an expert no row is routed to is not called."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(32, 8)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()) for _ in range(8)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if self.training:
            logits = logits + torch.randn_like(logits)
        choice = logits.argmax(-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows = (choice == index).nonzero().squeeze(-1)
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]))
        return x + out


class Routed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(32), NoisyExperts()) for _ in range(4)
        )
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, output_probs: bool = False) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out = self.head(x)
        return out.sigmoid() if output_probs else out


def test_calls_that_vary_inside_the_blocks_and_a_users_output_flag_are_no_refusal() -> None:
    # The experts a noisy router picks differ from call to call, inside the blocks: the run
    # of blocks is the same, so the random-run check must not refuse it; and an output_*
    # argument of the user's own (not a recorded output) must not refuse the step.
    torch.manual_seed(0)
    model = Routed().train()
    reference = copy.deepcopy(model)
    batch = {"x": torch.randn(6, 32), "output_probs": True}
    om = offremat.optimize(model, batch, budget=0.9, blocks="blocks")
    assert "recompute" in om.plan.decisions.values()
    torch.manual_seed(3)
    om(**batch).pow(2).mean().backward()
    torch.manual_seed(3)
    reference(**batch).pow(2).mean().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert (ours.grad is None and theirs.grad is None) or torch.equal(ours.grad, theirs.grad)


def _loss(model: nn.Module, inputs: dict[str, torch.Tensor] | torch.Tensor) -> torch.Tensor:
    if isinstance(inputs, dict):
        return model(**inputs).loss
    return model(inputs).square().mean()


@pytest.mark.parametrize("transfer", ["torch.save", "copy.deepcopy"])
@pytest.mark.parametrize("kind", ["sequential", "own model", "hugging face"])
def test_an_optimized_model_pickles_and_trains_like_plain_autograd_after_loading(
    kind, transfer
) -> None:
    """Saved and loaded, or copied (an EMA or target network made after wrapping), an
    optimized model trains like plain autograd, with the plans it had and on a new shape."""
    torch.manual_seed(0)
    if kind == "hugging face":
        model, example = zoo.gpt2().train(), LM_BATCH
        ids = IDS[:, :48]
        other = {"input_ids": ids, "labels": ids}
    elif kind == "own model":
        model, example, other = zoo.ResidualNet().train(), FEATURES, FEATURES[:, :8]
    else:
        model = nn.Sequential(*[zoo.Residual(16) for _ in range(6)])
        example, other = FEATURES, FEATURES[:, :8]
    om = offremat.optimize(model, example, budget=0.5)
    _loss(om, example).backward()
    if transfer == "copy.deepcopy":
        loaded = copy.deepcopy(om)
    else:
        buffer = io.BytesIO()
        torch.save(om, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    reference = copy.deepcopy(loaded.model)
    for inputs in (example, other, example):  # the plan made before saving, and a new shape's
        for network in (loaded, reference):
            network.zero_grad(set_to_none=False)
            torch.manual_seed(1)
            _loss(network, inputs).backward()
        for p, q in zip(loaded.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
    assert loaded.cache_info()["plans"] == 2


def test_a_pickled_model_leaves_its_host_buffers_behind() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[zoo.Residual(64) for _ in range(6)])
    x = torch.randn(256, 64)
    om = offremat.optimize(model, x, budget=1.0, bandwidth="1GB/s", solver="offload-all")
    assert any(d == "offload" for d in om.plan.decisions.values())
    before = len(pickle.dumps(om))
    om(x).square().mean().backward()
    assert om._executor.host_buffer_bytes > 0
    assert len(pickle.dumps(om)) < before + 64 * 1024


class CheckpointsItsBlocks(zoo.ResidualNet):
    """A model with its own gradient-checkpointing flag, set: each block call checkpointed."""

    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        scale = self.scale * 0.5
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, scale, use_reentrant=self.use_reentrant)
        return self.head(h)


class StateOnlyBlocksCheckpointed(zoo.StateOnlyNet):
    """Blocks that take only the state, each call checkpointed: the stem and head join the
    chain, whose step then starts outside the model's checkpoints."""

    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.use_reentrant)
        return self.head(h)


class CheckpointsThroughAClosure(CheckpointsItsBlocks):
    """Older Hugging Face models' form: checkpoint(create_custom_forward(layer), ...)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        scale = self.scale * 0.5
        for block in self.blocks:

            def custom_forward(*inputs, block=block):
                return block(*inputs)

            h = torch.utils.checkpoint.checkpoint(
                custom_forward, h, scale, use_reentrant=self.use_reentrant
            )
        return self.head(h)


class CheckpointsPairsOfBlocks(CheckpointsItsBlocks):
    """A hand-written checkpoint_sequential: a method that runs two blocks, checkpointed."""

    def pair(self, h: torch.Tensor, scale: torch.Tensor, first: int) -> torch.Tensor:
        return self.blocks[first + 1](self.blocks[first](h, scale), scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        scale = self.scale * 0.5
        for first in range(0, len(self.blocks), 2):
            h = torch.utils.checkpoint.checkpoint(
                self.pair, h, scale, first, use_reentrant=self.use_reentrant
            )
        return self.head(h)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize(
    "model_class",
    [
        CheckpointsItsBlocks,
        StateOnlyBlocksCheckpointed,
        CheckpointsThroughAClosure,
        CheckpointsPairsOfBlocks,
    ],
)
def test_a_models_own_checkpointing_of_its_blocks_is_refused(model_class, use_reentrant) -> None:
    # The stages call the blocks themselves: the model's checkpoint around each call would be
    # gone (and with it the peak a fraction of keep-all was meant to be taken of), or wrap the
    # planned step.
    with pytest.raises(offremat.NotAChainError) as refusal:
        offremat.optimize(model_class(use_reentrant), FEATURES, budget=0.5)
    assert "under torch.utils.checkpoint itself" in str(refusal.value)
    assert "turn the model's checkpointing off" in str(refusal.value)


def test_checkpointing_inside_a_blocks_own_call_stays_and_is_not_named(caplog) -> None:
    # Hugging Face's gradient checkpointing runs inside each layer's __call__, which the
    # stages call: it stays with the block, and nothing is said.
    model = zoo.llama()
    model.activation_checkpointing_enable({"use_reentrant": False})
    with caplog.at_level("WARNING", logger="offremat"):
        offremat.optimize(model, LM_BATCH, budget=0.9)
    assert "torch.utils.checkpoint itself" not in caplog.text
    plain = zoo.ResidualNet()
    with caplog.at_level("WARNING", logger="offremat"):
        offremat.optimize(plain, FEATURES, budget=0.5)
    assert "torch.utils.checkpoint itself" not in caplog.text
