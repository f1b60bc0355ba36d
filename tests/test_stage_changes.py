"""What changed in the stages, in the words of the warning that plans anew and of a refusal
(``offremat._stage_state.describe_change``): read against the change actually made."""

from __future__ import annotations

from torch import nn

from offremat._stage_state import describe_change, stage_state


def _blocks(count: int = 4) -> nn.Sequential:
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0), nn.Linear(4, 4)) for _ in range(count)]
    )


def _change(model: nn.Module, make) -> str:
    before = stage_state([model])
    make(model)
    return describe_change(before, stage_state([model]))


def test_a_change_in_one_of_repeated_blocks_is_named_alone() -> None:
    """Aligned by a diff, raising one block's dropout read as every block added and removed
    (a review)."""
    assert _change(_blocks(), lambda m: setattr(m[1][1], "p", 0.3)) == "dropout rates changed (1)"


def test_each_kind_of_change_is_named_with_its_count() -> None:
    def hooks(model: nn.Module) -> None:
        for block in model:
            block[0].weight.register_hook(lambda grad: grad)

    assert _change(_blocks(), hooks) == "gradient hooks (register_hook) added to parameters (4)"
    assert _change(_blocks(), lambda m: m[0].requires_grad_(False)) == (
        "parameters' requires_grad changed (4)"
    )
    assert _change(_blocks(), lambda m: m.eval()) == (
        "modules switched between training and eval (17)"
    )
    added = _change(_blocks(), lambda m: m.append(nn.Linear(4, 4)))
    assert added == "modules added (1); parameters added (2)"
    hooked = _change(_blocks(), lambda m: m[2].register_forward_hook(lambda *args: None))
    assert hooked == "module hooks added (1)"


def test_a_module_added_with_a_mode_switch_is_named_by_kind() -> None:
    """Where entries come or go, counted by kind: a diff aligning them took 21 s on 30,000
    entries (a review), at a step that switched to eval()."""
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(1_000)])
    assert _change(model, lambda m: m.append(nn.ReLU()).eval()) == (
        "modules added (1); modules switched between training and eval (1001)"
    )
