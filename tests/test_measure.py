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
