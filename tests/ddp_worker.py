"""A rank of ``tests/test_compose_ddp.py``: a Hugging Face Llama optimized, then wrapped in
DistributedDataParallel, trained on this rank's batch (gloo on CPU).

Prints the largest difference of the first step's gradients from plain autograd's on every
rank's batch (the mean of the ranks' losses, as DDP averages), each step's measured peak
over the budget, whether ``optimize`` refused the model wrapped the other way round, and
whether a model that uses a block twice, or DDP told to find unused parameters, was refused
at its backward.
"""

from __future__ import annotations

import copy
import os

import model_zoo  # tests/, this script's folder
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import offremat
from offremat.measure import StepMemory


def batch_of(rank: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(rank))
    return {"input_ids": ids, "labels": ids}


def shared_block(rank: int) -> None:
    """A block used twice: DDP's hooks on its parameters' accumulation run once per stage."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
    model = nn.Sequential(nn.Linear(32, 32), block, nn.Linear(32, 32), block, nn.Linear(32, 1))
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(rank))
    trainer = DistributedDataParallel(offremat.optimize(model, x, budget=0.9))
    try:
        trainer(x).pow(2).mean().backward()
    except RuntimeError as error:
        print(f"rank {rank} shared block refused: {error}", flush=True)


def unused_parameters_sought(rank: int) -> None:
    """find_unused_parameters=True (the Trainer's default for a model that is not a Hugging
    Face one): DDP marks every parameter unused, the forward's graph not reaching them."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)]
    model = nn.Sequential(*blocks, nn.Linear(32, 1))
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(rank))
    optimized = offremat.optimize(model, x, budget=0.8)
    trainer = DistributedDataParallel(optimized, find_unused_parameters=True)
    try:
        trainer(x).pow(2).mean().backward()
    except RuntimeError as error:
        print(f"rank {rank} unused refused: {error}", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = model_zoo.llama()
    reference = copy.deepcopy(model)
    batch = batch_of(rank)
    try:
        offremat.optimize(DistributedDataParallel(copy.deepcopy(model)), batch, budget=0.5)
    except TypeError as error:
        print(f"rank {rank} refused: {error}", flush=True)
    optimized = offremat.optimize(model, batch, budget=0.5)
    trainer = DistributedDataParallel(optimized)
    for parameter in model.parameters():  # gradients are not activations: allocated once
        parameter.grad = torch.zeros_like(parameter)
    for step in range(3):
        with StepMemory("cpu", inputs=batch) as memory:
            loss = trainer(**batch).loss
            loss.backward()
        peak = memory.peak_bytes / optimized.plan.budget_bytes
        print(f"rank {rank} step {step} loss {loss.item():.4f} peak/budget {peak:.3f}", flush=True)
        if step == 0:
            total = sum(reference(**batch_of(r)).loss for r in range(world)) / world
            total.backward()
            pairs = zip(model.parameters(), reference.parameters(), strict=True)
            diff = max((p.grad - q.grad).abs().max().item() for p, q in pairs)
            print(f"rank {rank} gradient difference {diff:.3g}", flush=True)
        for parameter in model.parameters():
            parameter.grad.zero_()
    shared_block(rank)
    unused_parameters_sought(rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)  # gloo's threads now and then abort the interpreter's teardown
