"""Train a model with offremat under FSDP2: ``fully_shard`` per block and on the root.

    torchrun --nproc-per-node 2 experiments/fsdp_train.py --model gpt --solver dp --budget 0.5

``--model gpt`` is the in-repo GPT (an ``nn.Sequential``; every block is sharded, the
embedding and the head too); ``--model llama`` a small Hugging Face Llama built from a config,
its decoder layers sharded and the chain found in it as for any model (:mod:`offremat._run`
says how FSDP2's hooks run with it). ``--no-reshard-after-forward`` shards the blocks with
``reshard_after_forward=False`` (their gathered parameters stay from the forward to the
backward, ZeRO-2 style).

The same script runs on CPUs (gloo) and on GPUs (NCCL, one device per rank): a user who
outgrows one device runs it unchanged on many. Budgets are activation memory per rank, as
design.md defines it, measured independently on each rank (:class:`offremat.measure.StepMemory`).

Every rank profiles the model together (FSDP's gathers are collectives, so every rank must run
the same forwards and backwards); rank 0's chain and plan are then given to every rank, so
that all of them run the same plan and issue the same collectives in the same order.

With ``--check``, rank 0 also trains an unsharded copy of the model with plain autograd on the
concatenation of every rank's batch, and the first step's gradients (gathered from their
shards) are compared with it; the script exits with status 1 if they differ by more than
1e-6 or a measured peak passes the budget (times 1 + ``--peak-slack``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import offremat
from offremat.measure import StepMemory
from offremat.models import GPTConfig, build_gpt, gpt_batch

TOLERANCE = 1e-6


def build(name: str, rank: int, device: torch.device) -> tuple[nn.Module, list[nn.Module], Any]:
    """The model, its blocks (each gets ``fully_shard``) and this rank's batch."""
    if name == "gpt":
        config = GPTConfig(layers=4, hidden=64, heads=2, seq=32, vocab=128, dropout=0.0)
        model = build_gpt(config, seed=0).to(device)
        # An nn.Sequential is run stage by stage, never through its own forward, so the
        # embedding and the head are sharded as blocks too: the root then holds no parameter
        # that only its own forward would gather.
        return model, list(model), (gpt_batch(config, 4, seed=rank, device=str(device)),)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            num_hidden_layers=4,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=96,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        model = LlamaForCausalLM(config).to(device)
        tokens = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(rank))
        tokens = tokens.to(device)
        return model, list(model.model.layers), {"input_ids": tokens, "labels": tokens}
    raise ValueError(f"unknown model {name!r}")


def loss_of(model: nn.Module, batch: Any) -> torch.Tensor:
    output = model(**batch) if isinstance(batch, dict) else model(*batch)
    return output if isinstance(output, torch.Tensor) else output.loss


def reference_grads(name: str, device: torch.device, world: int) -> dict[str, torch.Tensor]:
    """Plain autograd on one process: the mean of every rank's loss, unsharded."""
    model, _, _ = build(name, 0, device)
    loss = sum(loss_of(model, build(name, r, device)[2]) for r in range(world)) / world
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    parser.add_argument("--solver", default="dp")
    parser.add_argument("--budget", type=float, default=0.5, help="fraction of keep-all")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="compare with one process")
    parser.add_argument(
        "--no-reshard-after-forward",
        action="store_true",
        help="fully_shard(block, reshard_after_forward=False): gathered parameters kept "
        "from each block's forward to its backward",
    )
    parser.add_argument(
        "--peak-slack", type=float, default=0.0, help="fail only above budget x (1 + this)"
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    device = device or torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model, blocks, batch = build(args.model, rank, device)
    for block in blocks:
        fully_shard(block, reshard_after_forward=not args.no_reshard_after_forward)
        # No implicit prefetch of the next block's parameters in the backward: it would hold
        # two blocks' gathered parameters at times the profile (one gather at a time) and so
        # the plan do not see, depending on timing.
        block.set_modules_to_backward_prefetch([])
    fully_shard(model)
    # Before any forward, as with FSDP2 alone: after one, a module sharded with
    # reshard_after_forward=False lists its gathered parameters, not the sharded ones.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # Parameter gradients are not activation memory: they exist, as after a first step.
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)

    options = {"time_limit_s": 10} if args.solver == "milp" else {}
    example = batch[0] if isinstance(batch, tuple) else batch  # a Sequential takes one input
    with torch.no_grad():  # FSDP's lazy initialisation from the root, as in training
        loss_of(model, batch)
    om = offremat.optimize(model, example, budget=args.budget, solver=args.solver, **options)
    shared = [om.chain, om.plan]
    dist.broadcast_object_list(shared, src=0)  # one plan, so that the collectives match
    om = offremat.optimize(model, example, chain=shared[0], plan=shared[1])

    failed = False
    for step in range(args.steps):
        with StepMemory(device, inputs=batch) as memory:
            loss = loss_of(om, batch)
            loss.backward()
        peak, budget = memory.peak_bytes, om.plan.budget_bytes
        print(
            f"rank {rank} step {step}: loss {loss.item():.4f}, measured peak "
            f"{peak / 2**20:.2f} MiB of {budget / 2**20:.2f} MiB budget ({peak / budget:.3f})",
            flush=True,
        )
        failed |= peak > budget * (1 + args.peak_slack)
        if step == 0 and args.check:
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            if rank == 0:
                expected = reference_grads(args.model, device, world)
                diff = max((grads[n] - g).abs().max().item() for n, g in expected.items())
                print(f"largest gradient difference from one process: {diff:.3g}", flush=True)
                failed |= diff > TOLERANCE
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    if rank == 0:
        print(f"plan: {om.plan.decisions}", flush=True)
    verdict = torch.tensor([int(failed)], device=device)
    dist.all_reduce(verdict)
    # Both ranks past every collective before either tears gloo down: a rank that exits
    # while the other's gloo threads still talk to it aborts ("terminate called...").
    dist.barrier()
    dist.destroy_process_group()
    return int(verdict.item() > 0)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without the interpreter's teardown: gloo's threads now and then abort it
    # ("terminate called without an active exception", 1 run in 5) after every result is in.
    os._exit(code)
