"""The profiler turns a chain of modules into a Chain whose sizes are the executor's."""

from __future__ import annotations

import itertools
import json
import logging
import random
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import offremat
from offremat._blocks import NotAChainError, group_evenly
from offremat.cli import main
from offremat.models import GPTConfig, build_gpt, gpt_batch
from offremat.profiler import parse_bandwidth, profile_model, stage_modules
from solvers.chain import Chain, Link

FLOAT = 4


def quick(model, x, **options) -> Chain:
    return profile_model(model, x, warmup=0, repeats=1, **options)


def test_one_stage_per_block_named_after_the_blocks() -> None:
    model = nn.Sequential()
    model.add_module("first", nn.Linear(4, 4))
    model.add_module("second", nn.Tanh())
    chain = quick(model, torch.randn(2, 4))
    assert chain.stage_names == ("first", "second")
    assert chain.metadata["grouping"] == {"first": ["first"], "second": ["second"]}
    assert all(s.fwd_s > 0 and s.bwd_s >= 0 for s in chain.stages)
    assert chain.link is None  # no link on a CPU without bandwidth=


def test_sizes_count_storages_once_and_leave_out_the_input_and_parameters() -> None:
    batch, width = 8, 16
    activation = batch * width * FLOAT
    model = nn.Sequential(
        # Linear saves its input (not counted) and tanh saves its output (= a_1).
        nn.Sequential(nn.Linear(width, width), nn.Tanh()),
        # ReLU's output is saved by ReLU and by the second Linear: one storage, plus a_2.
        nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)),
        # A view of the input: the output shares the input's storage.
        nn.Flatten(0, 1),
    )
    x = torch.randn(batch, width)
    chain = quick(model, x)
    first, second, flatten = chain.stages
    assert chain.input_bytes == activation
    assert (first.out_bytes, first.saved_bytes) == (activation, activation)
    assert (second.out_bytes, second.saved_bytes) == (activation, 2 * activation)
    assert (flatten.out_bytes, flatten.saved_bytes) == (activation, activation)
    # Temporaries are measured on CPU too: the Linear's output lives until tanh has run, and
    # the backward holds at least the weight's transient gradient.
    assert first.fwd_tmp_bytes == activation
    assert first.bwd_tmp_bytes >= width * width * FLOAT


def test_tuple_outputs_count_each_storage_once() -> None:
    class PassTargets(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, batch):
            hidden, targets = batch
            return self.linear(hidden), targets

    model = nn.Sequential(PassTargets(), PassTargets())
    hidden, targets = torch.randn(3, 4), torch.arange(3)
    chain = quick(model, (hidden, targets))
    assert chain.input_bytes == 3 * 4 * FLOAT + 3 * 8
    # The output holds a new hidden state and the very same targets, which are the input's:
    # counted once, in a_0, not again in every stage that passes them on.
    assert chain.stages[0].out_bytes == 3 * 4 * FLOAT
    assert chain.stages[1].saved_bytes == 3 * 4 * FLOAT


def test_grouping_is_contiguous_named_and_reported(caplog: pytest.LogCaptureFixture) -> None:
    config = GPTConfig(layers=4, hidden=16, heads=2, seq=8, vocab=32)
    model = build_gpt(config)
    with caplog.at_level(logging.INFO, logger="offremat.profiler"):
        chain = quick(model, gpt_batch(config, 2), stages=3)
    assert chain.length == 3
    grouping = chain.metadata["grouping"]
    blocks = [name for name, _ in model.named_children()]
    assert [b for s in chain.stages for b in grouping[s.name]] == blocks
    for stage in chain.stages:
        members = grouping[stage.name]
        expected = members[0] if len(members) == 1 else f"{members[0]}..{members[-1]}"
        assert stage.name == expected
    assert "grouped 6 blocks into 3 stages" in caplog.text
    modules = stage_modules(model, chain)
    assert len(modules) == 3
    shared = [id(p) for module in modules for p in module.parameters()]
    assert shared == [id(p) for p in model.parameters()]


def test_group_evenly_minimizes_the_heaviest_group() -> None:
    rng = random.Random(0)
    for _ in range(30):
        weights = [rng.randint(1, 20) for _ in range(rng.randint(1, 8))]
        count = rng.randint(1, len(weights))
        groups = group_evenly(weights, count)
        assert [k for g in groups for k in g] == list(range(len(weights)))
        assert len(groups) == count and all(len(g) > 0 for g in groups)
        best = min(
            max(sum(weights[a:b]) for a, b in itertools.pairwise((0, *cuts, len(weights))))
            for cuts in itertools.combinations(range(1, len(weights)), count - 1)
        )
        assert max(sum(weights[k] for k in g) for g in groups) == best
    with pytest.raises(ValueError, match=r"pick 1\.\.3"):
        group_evenly([1, 2, 3], 4)


def test_profiling_leaves_rng_buffers_and_grads_untouched() -> None:
    model = nn.Sequential(
        nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6)), nn.Dropout(0.5), nn.Linear(6, 6)
    )
    model[2].weight.grad = torch.ones(6, 6)
    x = torch.randn(5, 6)
    buffers = [b.clone() for b in model.buffers()]
    torch.manual_seed(3)
    rng = torch.get_rng_state()
    quick(model, x)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers(), strict=True))
    assert torch.equal(model[2].weight.grad, torch.ones(6, 6))
    assert model[0][0].weight.grad is None


def test_bandwidth_sets_the_link() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    chain = quick(model, torch.randn(1, 2), bandwidth="25GB/s")
    assert chain.link == Link(25e9, 25e9)
    assert parse_bandwidth(2.5e10) == Link(2.5e10, 2.5e10)
    assert parse_bandwidth((1e9, "2GiB/s")) == Link(1e9, 2 * 2**30)
    assert parse_bandwidth("1.5e9 / s") == Link(1.5e9, 1.5e9)
    for bad in ("fast", -1, 0, (1, 2, 3)):
        with pytest.raises(ValueError):
            parse_bandwidth(bad)


def test_a_model_that_is_not_a_chain_is_refused_by_name() -> None:
    class Branchy(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(NotAChainError, match=r"Branchy is not a chain.*nn\.Sequential.*list of"):
        quick(Branchy(), torch.randn(2))
    with pytest.raises(NotAChainError, match="block 1 of the list is a str"):
        quick([nn.Linear(2, 2), "relu"], torch.randn(2))


def test_a_block_that_fails_without_autograd_is_named_with_what_to_do() -> None:
    """A hook registered on an activation in the forward works under autograd only; the
    profiler also runs each block under no_grad, and says so rather than PyTorch's bare
    error."""

    class Clipped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = self.linear(x)
            hidden.register_hook(lambda grad: grad.clamp(-1, 1))
            return torch.tanh(hidden)

    model = nn.Sequential(nn.Linear(8, 8), Clipped())
    with pytest.raises(RuntimeError, match=r"stage '1' fails under torch.no_grad.*require grad"):
        profile_model(model, torch.randn(4, 8))


def test_an_input_on_another_device_is_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="input is on cpu but the model's parameters are on meta"):
        quick(model, torch.randn(1, 2))


def test_a_list_of_blocks_profiles_like_a_sequential() -> None:
    blocks = [nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3)]
    x = torch.randn(4, 3)
    from_list = quick(blocks, x)
    from_sequential = quick(nn.Sequential(*blocks), x)
    assert from_list.stage_names == ("0", "1", "2")
    sizes = [(s.out_bytes, s.saved_bytes) for s in from_list.stages]
    assert sizes == [(s.out_bytes, s.saved_bytes) for s in from_sequential.stages]


def test_stage_modules_refuses_a_chain_of_another_model() -> None:
    chain = quick(nn.Sequential(nn.Linear(2, 2), nn.Tanh()), torch.randn(1, 2))
    with pytest.raises(ValueError, match="profile this model"):
        stage_modules(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Tanh()), chain)


def test_cli_profiles_an_in_repo_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "chain.json"
    args = ["profile", "gpt-tiny", "--out", str(out), "--warmup", "0", "--repeats", "1"]
    assert main([*args, "--stages", "2", "--bandwidth", "10GB/s"]) == 0
    chain = Chain.load(out)
    assert chain.length == 2 and chain.link == Link(1e10, 1e10)
    assert "wrote" in capsys.readouterr().out


def test_cli_profiles_a_module_callable(tmp_path: Path) -> None:
    source = tmp_path / "my_models.py"
    source.write_text(
        "import torch\n"
        "from torch import nn\n"
        "def mlp(batch_size=2):\n"
        "    return nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(batch_size, 4)\n"
        "def broken():\n"
        "    return 3\n"
        "def not_a_module():\n"
        "    return 'gpt2', torch.randn(2, 4)\n"
    )
    out = tmp_path / "chain.json"
    common = ["--out", str(out), "--warmup", "0", "--repeats", "1"]
    assert main(["profile", f"{source}:mlp", "--batch", "5", *common]) == 0
    data = json.loads(out.read_text())
    assert data["input_bytes"] == 5 * 4 * FLOAT
    assert main(["profile", f"{source}:broken", *common]) == 2
    assert main(["profile", f"{source}:not_a_module", *common]) == 2
    assert main(["profile", f"{source}:mlp", "--device", "meta", *common]) == 2
    assert main(["profile", f"{source}:missing", *common]) == 2
    assert main(["profile", "no-such-model", *common]) == 2
    assert main(["profile", "gpt-tiny", "--stages", "0", *common]) == 2


def test_cli_profiles_a_model_built_in_eval_mode_in_training_mode(tmp_path: Path) -> None:
    """A training step is what gets planned, so the CLI profiles as ``optimize`` does: a model
    built in eval mode (as from_pretrained returns it) in training mode, where dropout saves
    its masks (in eval mode these stages measured 32768 B each instead of 98304 B)."""
    code = (
        "import torch\n"
        "from torch import nn\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    blocks = [nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Dropout(0.2))\n"
        "              for _ in range(3)]\n"
        "    return nn.Sequential(*blocks).eval(), torch.randn(128, 64)\n"
    )
    source = tmp_path / "eval_models.py"
    source.write_text(code)
    out = tmp_path / "chain.json"
    assert main(["profile", f"{source}:build", "--out", str(out), "--warmup", "0"]) == 0
    built: dict = {}
    exec(code, built)
    model, x = built["build"]()
    training = quick(model.train(), x)
    evaluating = quick(model.eval(), x)
    assert evaluating.stages[0].saved_bytes < training.stages[0].saved_bytes
    profiled = Chain.load(out)
    assert [s.saved_bytes for s in profiled.stages] == [s.saved_bytes for s in training.stages]


def test_cli_imports_a_module_from_the_working_directory(tmp_path, monkeypatch) -> None:
    """``offremat profile my_models:mlp`` run beside my_models.py, as ``python -m`` would
    find it (a console script does not put the working directory on its path); with
    ``--threads``, the profile runs on that many threads."""
    (tmp_path / "beside.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def mlp():\n    return nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    threads = torch.get_num_threads()
    try:
        assert main(["profile", "beside:mlp", "--out", "c.json", "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert Chain.load(tmp_path / "c.json").length == 2


def test_a_doubling_stage_has_no_backward_temporary() -> None:
    # Its backward makes δ_{i-1} = 2·δ_i and nothing else: the incoming δ_i (already resident)
    # and the outgoing δ_{i-1} (counted by the plan) are not temporaries.
    class Double(nn.Module):
        def forward(self, x):
            return x * 2

    model = nn.Sequential(nn.Linear(64, 64), Double(), nn.Linear(64, 64))
    chain = quick(model, torch.randn(256, 64))
    double = chain.stage(2)
    # And it lets go of its output, which no node saved, as it starts (so would autograd).
    assert double.bwd_tmp_bytes == -double.out_bytes
    assert double.saved_bytes == double.out_bytes == double.grad_bytes == 256 * 64 * FLOAT


def test_outputs_sharing_a_storage_reach_the_next_stage_sharing_it() -> None:
    # The profiler hands the next stage copies of a stage's outputs; two outputs over one
    # storage (a tensor and a view of it) must stay one storage, as they are in training.
    class TensorAndView(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(64, 64)

        def forward(self, x):
            y = self.linear(x)
            return y, y[:, :32]

    class PassOn(nn.Module):
        def forward(self, pair):
            return pair

    class Join(nn.Module):
        def forward(self, pair):
            return pair[0] + pair[1].sum()

    model = nn.Sequential(TensorAndView(), PassOn(), Join())
    chain = quick(model, torch.randn(256, 64))
    assert chain.stage(2).out_bytes == chain.stage(1).out_bytes == 256 * 64 * FLOAT


class HeavyTail(nn.Module):
    """A light head whose output the tail's matmul saves, then a heavy tail that saves
    nothing the step holds beyond it: a refill stops before the tail's matmul runs."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.head = nn.Linear(width, width)
        self.tail = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.head(x))
        for _ in range(6):  # each product saves its input: the last one is saved before it runs
            h = h @ self.tail
        return h + 1


def test_a_refill_is_timed_to_the_last_saved_tensor_and_is_free_when_there_is_none() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), HeavyTail(512))
    chain = profile_model(model, torch.randn(1024, 512), warmup=1, repeats=5)
    first, second = chain.stages
    # A linear layer saves only its input and weight, which the step never holds.
    assert first.refill_s == 0.0
    # Five of the six products run again; the last, and the add, do not.
    assert 0 < second.refill_s < 0.95 * second.fwd_s


class MatMul(torch.autograd.Function):
    """x @ w, keeping what its backward needs on ``ctx`` or through ``save_for_backward``."""

    keep = "attributes"  # or "tuple", or "saved"

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if MatMul.keep == "attributes":
            ctx.x, ctx.w = x, w
        elif MatMul.keep == "tuple":
            ctx.pair = (x, w)
        else:
            ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if MatMul.keep == "attributes":
            x, w = ctx.x, ctx.w
        else:
            x, w = ctx.pair if MatMul.keep == "tuple" else ctx.saved_tensors
        return grad @ w.t(), x.t() @ grad


class CustomBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(MatMul.apply(x, self.weight)) + x


@pytest.mark.parametrize(
    ("keep", "named"), [("attributes", r"ctx\.x\)"), ("tuple", r"ctx\.pair\)"), ("saved", None)]
)
def test_activations_kept_on_ctx_are_refused_and_saved_ones_profiled(
    keep: str, named: str | None
) -> None:
    """A plan cannot free what autograd's hooks never see: ``ctx.x = x`` held x until the
    backward whatever the plan said (1.6x the budget measured). The weight on ``ctx`` is a
    parameter, no activation."""
    torch.manual_seed(0)
    model = nn.Sequential(*[CustomBlock() for _ in range(3)])
    x = torch.randn(64, 16)
    MatMul.keep = keep
    try:
        if named is not None:
            with pytest.raises(ValueError, match=rf"MatMul \({named}.*ctx\.save_for_backward"):
                profile_model(model, x, warmup=0, repeats=1)
        else:
            assert profile_model(model, x, warmup=0, repeats=1).length == 3
    finally:
        MatMul.keep = "attributes"


class SparseBlock(nn.Module):
    """Saves a sparse activation (torch.sparse.mm keeps its sparse input)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.weight = nn.Linear(16, 16), nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sparse.mm(torch.relu(self.linear(x)).to_sparse(), self.weight)


def test_a_sparse_saved_tensor_is_refused_with_what_to_do() -> None:
    model = nn.Sequential(*[SparseBlock() for _ in range(3)])
    with pytest.raises(ValueError, match=r"stage '0' saves a sparse_coo tensor.*blocks="):
        profile_model(model, torch.randn(32, 16), warmup=0, repeats=1)


class JaggedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(h)) + h


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided])
def test_a_nested_batch_is_refused_saying_to_pad_it(layout: torch.layout) -> None:
    """Plain autograd trains on variable-length sequences in a nested tensor; offremat cannot
    count its bytes. The error named the layout only (jagged), or was torch's own from inside
    offremat (strided: "NestedTensorImpl doesn't support sizes")."""
    sequences = [torch.randn(n, 16) for n in (3, 5, 4)]
    batch = torch.nested.nested_tensor(sequences, layout=layout)
    model = nn.Sequential(*[JaggedBlock() for _ in range(3)])
    with pytest.raises(TypeError, match=r"nested tensor.*to_padded_tensor.*plain autograd"):
        offremat.optimize(model, batch, budget=0.5)
