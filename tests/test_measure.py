"""The independent memory measurement sees every allocation of a step, frees and resizes
included, and nothing that existed before it."""

from __future__ import annotations

import torch

from offremat._tensors import allocated_bytes
from offremat.measure import LiveStorageTracker, StepMemory, cuda_blocks_split_exactly


def test_tracker_counts_live_storages_once_and_forgets_freed_ones() -> None:
    with LiveStorageTracker() as tracker:
        first = torch.ones(1000)
        view = first[10:20]
        view.add_(1.0)
        second = torch.zeros(500)
        assert tracker.live_bytes == 6000
        del second
        assert tracker.live_bytes == 4000
    assert tracker.peak_bytes == 6000


def test_tracker_ignores_what_existed_before_and_sees_resizes() -> None:
    before = torch.ones(1000)
    with LiveStorageTracker() as tracker:
        before.add_(1.0)
        made = torch.ones(100)
        assert tracker.live_bytes == 400
        made.untyped_storage().resize_(0)
        assert tracker.live_bytes == 0
        made.untyped_storage().resize_(800)
        torch.ones(1)  # any op
        assert tracker.live_bytes == 800


def test_a_reused_address_is_a_new_storage() -> None:
    # The allocator may give a freed storage's address to the next one: both must count.
    with LiveStorageTracker() as tracker:
        for _ in range(20):
            a = torch.ones(4096)
            del a
            b = torch.ones(4096)
            assert tracker.live_bytes == 4096 * 4
            del b
    assert tracker.peak_bytes == 4096 * 4


def test_step_memory_adds_the_input_once() -> None:
    x = torch.ones(256)
    pair = (x, x[:10])
    with StepMemory("cpu", pair) as memory:
        y = x * 2
        del y
    assert memory.input_bytes == 1024
    assert memory.peak_bytes == 2048


def test_sizes_on_cuda_are_counted_in_the_allocators_512_byte_blocks() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [allocated_bytes(n, cuda) for n in (0, 1, 512, 513, 4096)] == [0, 512, 512, 1024, 4096]
    assert [allocated_bytes(n, cpu) for n in (0, 1, 513)] == [0, 1, 513]


def test_expandable_segments_are_read_from_the_allocator_settings(monkeypatch) -> None:
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    for setting, exact in (
        ("", False),
        ("expandable_segments:False", False),
        ("max_split_size_mb:128, expandable_segments:True", True),
        ("expandable_segments:true", True),
    ):
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", setting)
        assert cuda_blocks_split_exactly() is exact
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert cuda_blocks_split_exactly()


def _step_peaks(model: torch.nn.Module, x: torch.Tensor, grads_made: bool) -> tuple[int, int]:
    for p in model.parameters():
        p.grad = None if grads_made else torch.zeros_like(p)
    with StepMemory("cpu", x, gradients_of=list(model.parameters())) as memory:
        model(x).square().sum().backward()
    assert memory.peak_less_gradients_bytes is not None
    return memory.peak_bytes, memory.peak_less_gradients_bytes


def test_gradients_made_in_a_step_are_left_out_as_if_they_had_been_made_before() -> None:
    """The budget leaves parameters' gradients out: a step that makes them, measured less
    them, peaks where the same step peaks with them allocated before it (which the tracker
    never counts)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh()) for _ in range(6)]
    )
    x = torch.randn(64, 256)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    made, made_less = _step_peaks(model, x, grads_made=True)
    kept, kept_less = _step_peaks(model, x, grads_made=False)
    assert kept_less == kept  # nothing to leave out
    assert made_less == kept
    assert made > kept + weights // 2  # the gradients made count in the whole peak


def test_a_gradient_taken_by_an_earlier_hook_is_not_left_out_twice() -> None:
    """An optimizer run in the backward (torchtune's pattern) frees each gradient as soon as
    it is accumulated: the measurement sees the free, and leaves nothing else out."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
    x = torch.randn(32, 128)
    _, kept_less = _step_peaks(model, x, grads_made=False)
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        for p in model.parameters()
    ]
    try:
        made, made_less = _step_peaks(model, x, grads_made=True)
    finally:
        for hook in hooks:
            hook.remove()
    assert made == made_less
    assert made_less <= kept_less


class _Prefixed(torch.nn.Module):
    """A learned token put before the activations with ``torch.cat``: autograd hands the
    token, as its gradient, a slice of the gradient of the whole concatenation."""

    def __init__(self, width: int = 256):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.prefix = torch.nn.Parameter(torch.randn(1, width))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        a = self.linear(x)
        return a * torch.sigmoid(a) * torch.tanh(a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Recomputed in the backward, after the token's gradient is accumulated, as a plan
        # recomputes its stages.
        a = torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
        return torch.cat([self.prefix, a]) * 2


def test_a_gradient_that_is_a_slice_leaves_out_its_own_bytes_alone() -> None:
    """A review found the whole concatenation's gradient left out with the token's: the
    activations' part of it, still alive through the recomputation, was not counted (8 MiB
    under the step with gradients made before). Only the token's own bytes are left out."""
    torch.manual_seed(0)
    model, x = _Prefixed(), torch.randn(1023, 256, requires_grad=True)
    _, made_less = _step_peaks(model, x, grads_made=True)
    assert model.prefix.grad.untyped_storage().nbytes() > 1000 * model.prefix.nbytes
    kept, _ = _step_peaks(model, x, grads_made=False)
    assert made_less == kept - model.prefix.nbytes


class _Fused(torch.nn.Module):
    """A weight made of three parameters by ``torch.cat`` (a fused query, key and value):
    each parameter's gradient is a slice of one storage that holds nothing else."""

    def __init__(self, width: int = 256):
        super().__init__()
        self.parts = torch.nn.ParameterList(torch.randn(width, width) for _ in range(3))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ torch.cat(list(self.parts))).repeat(1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Recomputed in the backward, after the later layers' gradients are made.
        return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)


def test_gradients_that_share_a_storage_are_all_left_out() -> None:
    # Left out only where one gradient filled its storage, the three were counted as
    # activations: a false "over its budget" at every measured step (a review).
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(*[_Fused() for _ in range(4)]), torch.randn(64, 3 * 256)
    _, made_less = _step_peaks(model, x, grads_made=True)
    for layer in model:  # the layers after the first made theirs before the peak
        assert len({p.grad.untyped_storage()._cdata for p in layer.parts}) == 1
    kept, _ = _step_peaks(model, x, grads_made=False)
    assert made_less == kept


def test_where_gradients_cannot_be_told_apart_the_check_is_put_off_once() -> None:
    """On CUDA (no peak less gradients) a step over by no more than the gradients it made
    leaves the check to the next; over by as little again, the plan counts as over its budget
    (its shape is profiled) rather than every step being measured."""
    from types import SimpleNamespace

    from offremat._step_budget import end_verification

    executor = SimpleNamespace(
        plan=SimpleNamespace(budget_bytes=1000),
        chain=SimpleNamespace(metadata={}),  # a chain of blocks alone: nothing around them
        verify_again=False,
        verify_next=True,
    )
    on_cuda, on_cpu = torch.device("cuda"), torch.device("cpu")
    cuda = SimpleNamespace(peak_bytes=1100, peak_less_gradients_bytes=None, device=on_cuda)
    end_verification(executor, cuda, new_grad_bytes=200)
    assert (executor.over_budget, executor.verify_next) == (False, True)
    end_verification(executor, cuda, new_grad_bytes=200)
    assert (executor.over_budget, executor.verify_next) == (True, False)
    executor.verify_again = False
    end_verification(
        executor,
        SimpleNamespace(peak_bytes=1300, peak_less_gradients_bytes=None, device=on_cuda),
        200,
    )
    assert (executor.over_budget, executor.verify_next) == (True, False)
    cpu = SimpleNamespace(peak_bytes=1100, peak_less_gradients_bytes=990, device=on_cpu)
    end_verification(executor, cpu, new_grad_bytes=200)
    assert (executor.over_budget, executor.verify_next, executor.verify_again) == (False,) * 3
