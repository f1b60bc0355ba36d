"""Activations as flat lists of tensors, and the storages they occupy.

A stage may take and return a tensor, or a tuple or list of them mixed with other values (an
``nn.Sequential`` passes whatever one child returns to the next). The profiler and the executor
see an activation as its tensors in a fixed order plus a :class:`Structure` that rebuilds it.
Memory is counted per storage, not per tensor, so views and tensors passed through unchanged
count once (Herrmann, Beaumont et al. 2019 count an activation's bytes the same way).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes


@dataclass(frozen=True)
class Structure:
    """How to rebuild an activation from its tensors: nesting, and the non-tensor values."""

    kind: str  # "tensor", "sequence", "dict" or "value"
    children: tuple[Structure, ...] = ()
    value: Any = None


def flatten(value: Any) -> tuple[list[torch.Tensor], Structure]:
    """The tensors of an activation, in order, and the structure that puts them back."""
    tensors: list[torch.Tensor] = []
    return tensors, _visit(value, tensors)


def unflatten(tensors: Iterable[torch.Tensor], structure: Structure) -> Any:
    """The activation that :func:`flatten` took apart, with ``tensors`` in its tensors' places."""
    return _build(structure, iter(tensors))


# Module-level recursion, not nested closures: a recursive closure is a reference cycle that
# would keep the activation's tensors alive until the cyclic garbage collector runs, long after
# the plan frees them.
def _visit(item: Any, tensors: list[torch.Tensor]) -> Structure:
    if isinstance(item, torch.Tensor):
        tensors.append(item)
        return Structure("tensor")
    if isinstance(item, (tuple, list)):
        return Structure("sequence", tuple(_visit(child, tensors) for child in item), type(item))
    if isinstance(item, dict):
        keys = tuple(item)
        children = tuple(_visit(item[key], tensors) for key in keys)
        return Structure("dict", children, (type(item), keys))
    return Structure("value", value=item)


def refuse_hidden_tensors(structure: Structure) -> None:
    """Refuse an activation whose tensors :func:`flatten` cannot see: a dataclass holding
    them, passed between stages, would carry them past the plan (their gradients and their
    memory)."""
    if structure.kind != "value":
        for child in structure.children:
            refuse_hidden_tensors(child)
        return
    item = structure.value
    if (
        dataclasses.is_dataclass(item)
        and not isinstance(item, type)
        and any(_holds_tensor(getattr(item, f.name, None)) for f in dataclasses.fields(item))
    ):
        raise TypeError(
            f"a dataclass {type(item).__name__} holding tensors is passed between stages or as "
            "the input; offremat sees tensors in tuples, lists, dicts and namedtuples only, and "
            "would miss these (their gradients and their memory). Pass its tensors in one of "
            "those (a namedtuple keeps the field names)"
        )


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(child) for child in value)
    if isinstance(value, dict):
        return any(_holds_tensor(child) for child in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_holds_tensor(getattr(value, f.name, None)) for f in dataclasses.fields(value))
    return False


def _build(node: Structure, remaining: Iterator[torch.Tensor]) -> Any:
    if node.kind == "tensor":
        return next(remaining)
    if node.kind == "value":
        return node.value
    items = [_build(child, remaining) for child in node.children]
    if node.kind == "dict":
        container, keys = node.value
        return container(zip(keys, items, strict=True))
    if hasattr(node.value, "_fields"):  # a namedtuple takes its fields as arguments
        return node.value(*items)
    return node.value(items)


def same_structure(a: Structure, b: Structure) -> bool:
    """Whether two structures have the same shape and the same values (by identity or ==)."""
    if a.kind != b.kind or len(a.children) != len(b.children):
        return False
    if a.kind == "value" and a.value is not b.value and a.value != b.value:
        return False
    return all(same_structure(x, y) for x, y in zip(a.children, b.children, strict=True))


def is_differentiable(tensor: torch.Tensor) -> bool:
    """Whether autograd can carry a gradient for the tensor's dtype."""
    return tensor.is_floating_point() or tensor.is_complex()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bits: a NaN equals itself (``torch.equal`` says it
    does not), -0.0 differs from 0.0, in real and complex tensors; sparse ones, part by part.
    Compared without allocating, but for a conjugate or negative view (``z.conj()``,
    ``z.conj().imag``), compared by its values."""
    if a.shape != b.shape or a.dtype != b.dtype or a.layout != b.layout:
        return False
    if a.layout != torch.strided:
        parts = zip(_strided_parts(a), _strided_parts(b), strict=True)
        return all(bitwise_equal(x, y) for x, y in parts)
    # Lazy conjugation and negation bits refuse both views below; resolving them copies.
    a, b = (t.resolve_conj().resolve_neg() for t in (a, b))
    if a.is_complex():  # its real and imaginary parts, so that a complex NaN equals itself
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.is_floating_point() and a.element_size() in _SAME_SIZE_INTEGER:
        a, b = (t.view(_SAME_SIZE_INTEGER[a.element_size()]) for t in (a, b))
    return torch.equal(a, b)


_SAME_SIZE_INTEGER = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def version_of(tensor: torch.Tensor) -> int:
    """The tensor's version counter; 0 for an inference tensor (made under
    ``torch.inference_mode``), which has none and cannot change in place outside it."""
    return 0 if tensor.is_inference() else tensor._version


TensorKind = tuple[torch.dtype, torch.Size, torch.device]


def tensor_kind(tensor: torch.Tensor) -> TensorKind:
    """What a recomputation must make again in a tensor's place: its dtype, shape and device."""
    return tensor.dtype, tensor.shape, tensor.device


def describe_kind(kind: TensorKind) -> str:
    """A kind for messages: ``float32 [8, 16] on cpu``."""
    dtype, shape, device = kind
    return f"{str(dtype).removeprefix('torch.')} {list(shape)} on {device}"


def version_owner(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose version counter ``tensor`` shares and that outlives it: a view's base.

    Autograd often saves a view (``F.linear`` reshapes a 3-d input), which dies once the
    step lets it go; an in-place change made later through the base, which the model may
    keep, moves the same counter, so a weak reference to the base still sees it.
    """
    return tensor if tensor._base is None else tensor._base


def storage_key(tensor: torch.Tensor) -> int:
    """An identity for the tensor's storage that survives resizing it (and views of it); for
    a sparse tensor, which has none of its own, its values' storage."""
    try:
        return tensor.untyped_storage()._cdata
    except NotImplementedError:
        return sparse_parts(tensor)[-1].untyped_storage()._cdata  # its values


def unique_storages(tensors: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    """The distinct non-empty storages behind ``tensors``, by :func:`storage_key`."""
    found: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        for part in _strided_parts(tensor):
            storage = part.untyped_storage()
            if storage.nbytes() > 0:
                found.setdefault(storage._cdata, storage)
    return found


def _strided_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensor, or the strided tensors a sparse one is made of (a sparse buffer)."""
    return (tensor,) if tensor.layout == torch.strided else sparse_parts(tensor)


def sparse_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The strided tensors that hold a sparse tensor's indices and values."""
    if tensor.layout == torch.sparse_coo:
        return (tensor._indices(), tensor._values())
    if tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
        return (tensor.crow_indices(), tensor.col_indices(), tensor.values())
    if tensor.layout in (torch.sparse_csc, torch.sparse_bsc):
        return (tensor.ccol_indices(), tensor.row_indices(), tensor.values())
    if tensor.is_nested:
        raise TypeError(
            f"offremat cannot measure a nested tensor of layout {tensor.layout} (variable-length "
            "sequences): it counts the bytes of strided and sparse tensors only. Pad the batch "
            "into one tensor (x.to_padded_tensor(0.0), with a mask for the padding), or train "
            "this model with plain autograd"
        )
    raise TypeError(
        f"offremat cannot measure a tensor of layout {tensor.layout}: it counts the bytes of "
        "strided and sparse tensors only. Convert it to one of those (x.to_dense()), or train "
        "this model with plain autograd"
    )


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each counted once, over the byte range the
    tensors reach in it.

    A batch sliced from a larger tensor (``data[i : i + 64]`` of a dataset kept on the
    device) holds its slice for the step, not the dataset, which was there before the step
    and stays after it; two views of one tensor (``ids[:, :-1]`` and ``ids[:, 1:]``) count
    the bytes they cover together once. Where the views' own elements take fewer bytes than
    that range (a column of a dataset), those count.
    """
    return sum(reached_bytes(tensors).values())


def reached_bytes(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """:func:`storage_bytes` per storage, by :func:`storage_key`."""
    reached: dict[int, list[tuple[int, int]]] = {}
    elements: dict[int, int] = {}
    for tensor in tensors:
        for part in _strided_parts(tensor):
            storage = part.untyped_storage()
            if storage.nbytes() > 0 and part.numel() > 0:
                key = storage._cdata
                reached.setdefault(key, []).append(_byte_range(part))
                elements[key] = elements.get(key, 0) + _element_bytes(part)
    return {key: min(_covered(ranges), elements[key]) for key, ranges in reached.items()}


def _element_bytes(tensor: torch.Tensor) -> int:
    """The bytes of the strided ``tensor``'s elements; of its range where a stride of 0
    repeats them (an expanded tensor)."""
    if any(stride == 0 and n > 1 for n, stride in zip(tensor.shape, tensor.stride(), strict=True)):
        start, stop = _byte_range(tensor)
        return stop - start
    return tensor.numel() * tensor.element_size()


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The first byte of its storage that the strided ``tensor`` reads and the one past its
    last."""
    size = tensor.element_size()
    last = sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride(), strict=True))
    start = tensor.storage_offset() * size
    return start, start + (last + 1) * size


def _covered(ranges: list[tuple[int, int]]) -> int:
    """Bytes in the union of the half-open ``ranges``."""
    total, end = 0, 0
    for start, stop in sorted(ranges):
        start = max(start, end)
        if stop > start:
            total += stop - start
            end = stop
    return total


def gradient_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the gradients of ``tensors``: one per tensor that carries a gradient, as the
    device's allocator counts it (:func:`offremat._tensors.allocated_bytes`)."""
    return sum(
        allocated_bytes(t.numel() * t.element_size(), t.device)
        for t in tensors
        if t.requires_grad and is_differentiable(t)
    )


CUDA_BLOCK_BYTES = 512
"""The CUDA caching allocator's granule: every block it hands out is a multiple of it."""


def allocated_bytes(nbytes: int, device: torch.device) -> int:
    """What ``nbytes`` made on ``device`` take from its allocator, as the peak counts them.

    The CUDA caching allocator rounds each block up to 512 bytes and ``memory_allocated``
    counts the rounded size; a chain profiled on a GPU counts the same, so that a plan at its
    least budget is not a few hundred bytes over it, measured.
    """
    if device.type == "cuda" and nbytes:
        return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return nbytes


def storage_allocated_bytes(storage: torch.UntypedStorage) -> int:
    """:func:`allocated_bytes` of one storage."""
    return allocated_bytes(storage.nbytes(), storage.device)


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage, with a version counter of its own.

    Copying into it does not bump the version of the tensors autograd saved from the storage,
    so refilling a storage after an offload leaves their saved-tensor checks intact.
    """
    return tensor_over(storage, torch.uint8, 0, (storage.nbytes(),), (1,))


def tensor_over(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    conj: bool = False,
    neg: bool = False,
) -> torch.Tensor:
    """A new tensor over ``storage``: no copy, and a version counter of its own.

    ``conj`` and ``neg`` are the lazy bits of a view (``z.conj()``, its ``.imag``): the bytes
    are the unconjugated, unnegated values, and the bits say how to read them.
    """
    # set_ only points a tensor at memory, but its schema marks the tensor as written. Outside
    # dispatch modes, a mode that tracks accesses per stream (TORCH_CUDA_SANITIZER) does not
    # take this for a write to the storage racing with the copies on the side streams. With
    # no mode active there is nothing to leave (leaving costs 5 µs, at every unpack of a view
    # of a stage's input).
    if not torch._C._len_torch_dispatch_stack():
        return _pointed(storage, dtype, offset, size, stride, conj, neg)
    with _disable_current_modes():
        return _pointed(storage, dtype, offset, size, stride, conj, neg)


def _pointed(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    conj: bool,
    neg: bool,
) -> torch.Tensor:
    tensor = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)
    if conj:
        tensor = tensor.conj()
    if neg:
        tensor = torch._neg_view(tensor)
    return tensor


def copied(tensors: Sequence[torch.Tensor], made: set[int]) -> list[torch.Tensor]:
    """``tensors``, those over a storage in ``made`` rebuilt over a copy of it (one copy per
    storage, so outputs that share a storage still share one)."""
    copies: dict[int, torch.UntypedStorage] = {}
    handed = []
    for tensor in tensors:
        key = storage_key(tensor)
        if key not in made:
            handed.append(tensor)
            continue
        if key not in copies:
            copies[key] = tensor.untyped_storage().clone()
        copy = tensor_over(
            copies[key],
            tensor.dtype,
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.is_conj(),
            tensor.is_neg(),
        )
        handed.append(copy.requires_grad_(tensor.requires_grad))
    return handed


def refuse_sparse_outputs(
    stage: str, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> None:
    """Refuse a stage that hands on a sparse tensor it made, or one that carries a gradient:
    the step counts, keeps and frees what passes between stages by storage, which a sparse
    tensor has not, and gives it no gradient. One it was given (an adjacency passed along
    the blocks) is counted by its parts and never moved."""
    given = {storage_key(t) for t in inputs}
    for tensor in outputs:
        if tensor.layout == torch.strided:
            continue
        if tensor.requires_grad:
            raise ValueError(
                f"stage {stage!r} hands on a sparse tensor that carries a gradient (an "
                "adjacency built from a learnable weight): offremat gives no sparse tensor a "
                "gradient between stages. Build it inside each block from the weight, make "
                "it dense, or train this model without offremat"
            )
        if storage_key(tensor) not in given:
            raise ValueError(
                f"stage {stage!r} makes a sparse tensor and hands it on: offremat counts, "
                "keeps and frees what passes between stages by storage, which a sparse tensor "
                "has not. Make it before the blocks and pass it along, make it dense, or "
                "leave this block out of the chain (blocks= naming the others)"
            )
