"""The one walk a step makes over a stage's modules finds what the four former walks found."""

from __future__ import annotations

import torch
from torch import nn

from offremat._scan import module_generators, scan_modules
from offremat._tensors import storage_key


class Noisy(nn.Module):
    """Draws noise from a generator it keeps under a private name."""

    def __init__(self) -> None:
        super().__init__()
        self._noise = torch.Generator().manual_seed(0)
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + torch.rand(x.shape, generator=self._noise)


def test_the_scan_finds_trainable_parameters_fixed_storages_norms_and_generators() -> None:
    shared = nn.Linear(4, 4)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    norm, idle = nn.BatchNorm1d(4), nn.BatchNorm1d(4, track_running_stats=False)
    stage = nn.Sequential(shared, frozen, shared, norm, idle, Noisy(), nn.Linear(4, 4, bias=False))
    scan = scan_modules(stage)
    expected = [p for p in stage.parameters() if p.requires_grad]  # shared ones once
    assert [id(p) for p in scan.trainable] == [id(p) for p in expected]
    tensors = [*stage.parameters(), *stage.buffers()]
    assert scan.fixed_storages == {storage_key(t) for t in tensors}
    assert scan.norms == (norm,)
    assert scan.generators == (stage[5]._noise,) == module_generators(stage)
    stage.eval()
    assert scan_modules(stage).norms == ()  # eval() moves no running statistics


def test_generators_are_found_without_touching_other_tensors() -> None:
    model = nn.Sequential(Noisy(), nn.Linear(4, 4))
    # A sparse buffer has no storage to key; finding generators must not need one.
    model[1].register_buffer("mask", torch.eye(4).to_sparse())
    assert module_generators(model) == (model[0]._noise,)


class SeededGenerator(torch.Generator):
    """A generator of the user's own class."""


def test_a_generator_of_a_subclass_is_found() -> None:
    model = nn.Sequential(Noisy(), nn.Linear(4, 4))
    model[1].noise = SeededGenerator()
    assert module_generators(model) == (model[0]._noise, model[1].noise)
