"""What the model gets back from its calls of the run's blocks before the last one.

Inside a training step the chain runs every block at one of the model's calls, so the model's
other calls of the blocks get a stand-in for the block's output: :class:`HandedOn`, which it
may only pass to the next block. Any other use raises rather than compute with another
tensor than plain autograd would.
"""

from __future__ import annotations

from typing import Any

import torch

from offremat._block_values import stand_in


class HandedOn(torch.Tensor):
    """What the model sees a block other than the last return inside a training step.

    The chain computed that block's output but does not hand it out: the model gets a tensor
    that it may only pass to the next block (and ask its shape, dtype or device, those of the
    chain's output, where every block keeps its input's shape). Any other use, such as
    keeping it for a loss or a skip connection, raises instead of computing with the chain's
    final state. Where the blocks change the shape (strided stages), the block's own shape is
    not known, and where the chain runs at the last block's call (``deferred``) no output
    exists yet: even the shape is then refused rather than guessed.
    """

    path: str
    last: str  # the chain's last unit: a head after the blocks, where the chain took one in
    deferred: bool  # the chain runs at the model's call of its last block, after this one
    described: bool  # its shape, dtype and device are the block output's

    @staticmethod
    def of(result: torch.Tensor, path: str, last: str, described: bool) -> HandedOn:
        handed = torch.Tensor._make_subclass(HandedOn, result.detach(), result.requires_grad)
        handed.path, handed.last, handed.deferred = path, last, False
        handed.described = described
        return handed

    @staticmethod
    def before_run(path: str, last: str) -> HandedOn:
        handed = torch.Tensor._make_subclass(HandedOn, torch.empty(0))
        handed.path, handed.last, handed.deferred, handed.described = path, last, True, False
        return handed

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        handed = stand_in(HandedOn, args, kwargs)
        if func in _METADATA and (handed is None or handed.described):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        path = "a block" if handed is None else handed.path
        last = "its last unit" if handed is None else handed.last
        name = getattr(func, "__name__", func)
        if name == "__get__":  # a property: shape, dtype, device
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if handed is not None and handed.deferred:
            raise DeferredOutputError(
                f"the model used {path}'s output for more than calling the next block "
                f"({name}); its blocks take side inputs in turns (a mask per kind of "
                f"attention), so offremat runs them as a chain at the model's call of {last}, "
                "and until then no block's output exists, not even its shape. optimize "
                "plans such a model's longest run of blocks taking the same side inputs "
                "instead; in a training step, name that run with blocks=, or train with plain "
                "autograd. (A run of blocks that depends on the input or on random draws, "
                "such as an early exit, also ends this way: it is no fixed chain)"
            )
        if func in _METADATA:
            raise UnknownShapeError(
                f"the model asked {path}'s output its {name}; the blocks change the shape of "
                f"their state (strided stages), and the chain, which runs to {last}, hands "
                "on no block's output but its last, so that block's is not known: read the "
                "shapes before the blocks or after the last, or train with plain autograd"
            )
        raise HandedOnError(
            f"the model used {path}'s output for more than calling the next block "
            f"({name}); the chain runs to {last}, and inside it "
            f"only {last}'s output exists: name a run of blocks whose outputs only feed each "
            "other with blocks= (the container of the blocks, where the chain took in the "
            "layers after them), if the model has one: one that reads every block's output "
            "(a weighted sum of its layers, hidden states it returns) has none, so train it "
            "with plain autograd or turn that reading off. "
            "(A run of blocks that depends on the input or on random draws, such as an "
            "early exit or LayerDrop, also ends this way: it is no fixed chain)"
        )


class HandedOnError(RuntimeError):
    """A use of a block's output inside the chain, where only the chain's last exists.

    Not a TypeError (NotAChainError is one): torch turns those into NotImplemented for
    operators such as +, and the message would be lost."""


class UnknownShapeError(HandedOnError):
    """A block output's shape asked where only the chain's last is known."""


class DeferredOutputError(HandedOnError):
    """A use of a block's output before the chain, run at the last block's call, made it."""


_METADATA = {
    torch.Tensor.shape.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.requires_grad.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.__repr__,
}
