"""The ``offremat.chain/1`` format: round trips, validation messages, the shipped examples."""

from __future__ import annotations

import copy
import json
import math
import runpy
from pathlib import Path
from typing import Any

import pytest

from offremat import examples
from solvers.chain import Chain, ChainFormatError, Link, Stage

GENERATOR = Path(__file__).parent.parent / "experiments" / "make_example_chains.py"


def sample_dict() -> dict[str, Any]:
    return {
        "format": "offremat.chain/1",
        "name": "sample",
        "input_bytes": 16384,
        "stages": [
            {
                "name": "block0",
                "fwd_s": 0.0021,
                "bwd_s": 0.0043,
                "out_bytes": 8388608,
                "saved_bytes": 142606336,
                "fwd_tmp_bytes": 1024,
                "bwd_tmp_bytes": 2048,
            },
            {
                "name": "block1",
                "fwd_s": 0.001,
                "bwd_s": 0.002,
                "out_bytes": 4096,
                "saved_bytes": 8192,
            },
        ],
        "link": {"d2h_bytes_per_s": 2.5e10, "h2d_bytes_per_s": 2.0e10},
        "metadata": {"source": "test", "layers": [1, 2]},
    }


def test_json_round_trip_keeps_every_field(tmp_path: Path) -> None:
    chain = Chain.from_dict(sample_dict())
    assert chain.length == 2
    assert chain.stage(1).fwd_tmp_bytes == 1024
    assert chain.stage(2).bwd_tmp_bytes == 0  # optional temporaries default to 0
    assert chain.link == Link(2.5e10, 2.0e10)
    again = Chain.from_json(chain.to_json())
    assert again == chain
    assert again.metadata == {"source": "test", "layers": [1, 2]}
    chain.save(tmp_path / "c.json")
    loaded = Chain.load(tmp_path / "c.json")
    assert loaded == chain
    assert loaded.to_dict() == chain.to_dict()


def test_round_trip_keeps_gradient_sizes_that_differ_from_output_sizes() -> None:
    """A stage whose output holds an integer tensor (a mask, a target) has a smaller δ."""
    data = sample_dict()
    data["stages"][1]["grad_bytes"] = 2048
    data["input_grad_bytes"] = 0
    data["held_bytes"] = 4
    chain = Chain.from_dict(data)
    assert chain.grad_bytes(2) == 2048 and chain.grad_bytes(0) == 0
    assert Chain.from_json(chain.to_json()) == chain
    data["stages"][1]["grad_bytes"] = -1
    with pytest.raises(ChainFormatError, match="grad_bytes"):
        Chain.from_dict(data)


def test_round_trip_without_link() -> None:
    data = sample_dict()
    del data["link"]
    chain = Chain.from_dict(data)
    assert chain.link is None
    assert "link" not in chain.to_dict()
    assert Chain.from_json(chain.to_json()) == chain


def _set(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    data = copy.deepcopy(sample_dict())
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


def _drop(path: tuple[Any, ...]) -> dict[str, Any]:
    data = copy.deepcopy(sample_dict())
    target = data
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    return data


def _renamed(path: tuple[Any, ...], new_name: str) -> dict[str, Any]:
    data = _drop(path)
    target = data
    for key in path[:-1]:
        target = target[key]
    target[new_name] = _value_at(sample_dict(), path)
    return data


def _value_at(data: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        data = data[key]
    return data


@pytest.mark.parametrize(
    ("data", "must_name"),
    [
        (
            _renamed(("stages", 0, "saved_bytes"), "saved_byte"),
            ["stage 1", "'saved_byte' (did you mean 'saved_bytes'?)"],
        ),
        (
            _renamed(("link", "h2d_bytes_per_s"), "h2d_byte_per_s"),
            ["link", "did you mean 'h2d_bytes_per_s'"],
        ),
        (_drop(("format",)), ["missing field 'format'"]),
        (_renamed(("format",), "fromat"), ["'fromat' (did you mean 'format'?)"]),
    ],
)
def test_a_misspelled_required_field_is_named_with_the_field_it_misspells(
    data: dict[str, Any], must_name: list[str]
) -> None:
    """A required field misspelled was reported as missing, without the misspelling."""
    with pytest.raises(ChainFormatError) as caught:
        Chain.from_dict(data)
    for part in must_name:
        assert part in str(caught.value), f"{part!r} missing from: {caught.value}"


@pytest.mark.parametrize(
    ("data", "must_name"),
    [
        (_set(("stages", 1, "out_bytes"), -5), ["stage 2", "block1", "out_bytes", "non-negative"]),
        (_set(("stages", 0, "fwd_s"), -0.1), ["stage 1", "block0", "fwd_s", "non-negative"]),
        (_drop(("stages", 1, "bwd_s")), ["stage 2", "block1", "missing", "bwd_s"]),
        (_drop(("stages", 0, "saved_bytes")), ["stage 1", "saved_bytes", "missing"]),
        (_drop(("input_bytes",)), ["input_bytes", "missing"]),
        (_set(("format",), "offremat.chain/9"), ["format", "offremat.chain/9"]),
        (_drop(("format",)), ["format"]),
        (_set(("stages", 1, "fwd_s"), float("nan")), ["stage 2", "fwd_s", "finite"]),
        # An int too large for a float ended in OverflowError (a CLI traceback).
        (_set(("stages", 1, "fwd_s"), 10**400), ["stage 2", "fwd_s", "too large"]),
        (_set(("link", "d2h_bytes_per_s"), 10**400), ["link", "d2h_bytes_per_s", "too large"]),
        (_set(("stages", 1, "saved_bytes"), 10**400), ["stage 2", "saved_bytes", "about 1e400"]),
        # A picosecond per op in the simulator read as an overhead of 1e288 percent.
        (_set(("stages", 0, "fwd_s"), 1e-300), ["stage 1", "fwd_s", "give 0"]),
        (_set(("input_bytes",), 10**400), ["input_bytes", "about 1e400 bytes"]),
        (_set(("stages", 0, "saved_bytes"), 1.5e8 + 0.5), ["stage 1", "saved_bytes", "integer"]),
        (_set(("stages", 1, "out_bytes"), "4096"), ["stage 2", "out_bytes", "integer"]),
        (_set(("stages", 1, "saved_bytes"), 100), ["stage 2", "saved_bytes", "out_bytes"]),
        (_set(("stages", 0, "colour"), "red"), ["stage 1", "colour", "unknown"]),
        (_set(("stages", 0, "refill_s"), 0.003), ["stage 1", "refill_s", "fwd_s"]),
        (_set(("stages", 0, "refill_s"), -1.0), ["stage 1", "refill_s", "non-negative"]),
        (_set(("input_bytes",), -1), ["input_bytes", "non-negative"]),
        (_set(("stages",), []), ["stages", "empty"]),
        (_set(("link", "h2d_bytes_per_s"), 0), ["link", "h2d_bytes_per_s", "positive"]),
        (_drop(("link", "d2h_bytes_per_s")), ["link", "d2h_bytes_per_s", "missing"]),
        (_set(("link", "d2h_bytes_per_s"), "fast"), ["link", "d2h_bytes_per_s", "number"]),
        (_set(("stages", 1, "name"), 5), ["stage 2", "name", "string"]),
        (_set(("stages", 1, "name"), "block0"), ["stage 2", "block0", "earlier stage"]),
        (_set(("metadata",), [1]), ["metadata", "object"]),
        (_set(("metadata",), []), ["metadata", "object"]),
        (_set(("frozen_stage",), 2), ["chain", "frozen_stage", "unknown"]),
        (_set(("held_byte",), 8), ["chain", "held_byte", "unknown"]),
        (_set(("link", "d2h_latency_s"), 1e-5), ["link", "d2h_latency_s", "unknown"]),
        (_set(("name",), 7), ["chain", "name", "string"]),
        (_set(("stages", 0, "fwd_s"), 1e308), ["stage 1", "fwd_s", "longer than any"]),
        # milp's copy times, bytes over 1e300 B/s in its unit of time, made PuLP raise.
        (_set(("link", "d2h_bytes_per_s"), 1e300), ["d2h_bytes_per_s", "faster than any link"]),
    ],
)
def test_validation_error_names_the_stage_and_field(
    data: dict[str, Any], must_name: list[str]
) -> None:
    with pytest.raises(ChainFormatError) as caught:
        Chain.from_dict(data)
    message = str(caught.value)
    for part in must_name:
        assert part in message, f"{part!r} missing from: {message}"


def test_nan_written_in_json_text_is_rejected() -> None:
    text = json.dumps(sample_dict()).replace("0.0043", "NaN")
    with pytest.raises(ChainFormatError, match=r"stage 1 .*bwd_s.*finite"):
        Chain.from_json(text)


def test_nan_in_metadata_is_rejected_where_it_is() -> None:
    """JSON has no NaN: a chain must not carry one it would write back out."""
    data = sample_dict()
    data["metadata"] = {"profile": {"times": [0.1, math.nan]}}
    with pytest.raises(ChainFormatError, match=r"metadata\.profile\.times\[1\] is NaN"):
        Chain.from_json(json.dumps(data))


def test_invalid_json_text_is_a_format_error() -> None:
    with pytest.raises(ChainFormatError, match="not valid JSON"):
        Chain.from_json("{'format': ")


def test_stage_constructor_validates_too() -> None:
    with pytest.raises(ChainFormatError, match="fwd_tmp_bytes"):
        Stage("s", 1.0, 1.0, 10, 20, fwd_tmp_bytes=-1)


def test_shipped_examples_load_and_are_chain_shaped() -> None:
    assert set(examples.names()) >= {"transformer", "cnn", "llama7b"}
    for name in examples.names():
        chain = examples.load(name)
        assert chain.link is not None, name
        assert chain.metadata["generator"] == "experiments/make_example_chains.py"
        assert chain.metadata["formulas"], name
        # Every chain ends in a scalar fp32 loss.
        assert chain.stage(chain.length).out_bytes == 4
        assert all(s.fwd_s > 0 and s.bwd_s > 0 for s in chain.stages), name


def test_unknown_example_lists_the_examples() -> None:
    with pytest.raises(ValueError, match="transformer"):
        examples.path("no-such-model")


def test_examples_are_exactly_what_the_generator_derives(tmp_path: Path) -> None:
    generator = runpy.run_path(str(GENERATOR))
    assert generator["main"](["--out", str(tmp_path)]) == 0
    for name in examples.names():
        shipped = json.loads(examples.path(name).read_text())
        assert json.loads((tmp_path / f"{name}.json").read_text()) == shipped, name


def test_llama_block_follows_the_stated_formula() -> None:
    # 16·s·b·h + 8·s·b·f + 4·a·s·b with s=4096, b=1, h=4096, f=11008, a=32 (see metadata).
    chain = examples.load("llama7b")
    s, b, h, f, a = 4096, 1, 4096, 11008, 32
    block = chain.stage(2)
    assert block.saved_bytes == 16 * s * b * h + 8 * s * b * f + 4 * a * s * b
    assert block.out_bytes == 2 * s * b * h
    flops = 2 * s * b * (4 * h * h + 3 * h * f) + 4 * s * s * b * h
    assert block.fwd_s == pytest.approx(flops / 400e12)
    assert chain.link == Link(50e9, 50e9)
    assert sum(1 for st in chain.stages if st.name.startswith("block")) == 32


def test_gpt2_block_follows_korthikanti() -> None:
    chain = examples.load("transformer")
    s, b, h, a = 1024, 8, 768, 12
    assert chain.stage(2).saved_bytes == s * b * h * (34 + 5 * a * s // h)
    assert sum(1 for st in chain.stages if st.name.startswith("block")) == 12


def test_a_backward_temporary_may_be_negative_down_to_minus_the_saved_set() -> None:
    """A backward frees saved tensors node by node, so its peak can lie below x̄_i + δ_i."""
    assert Stage("s", 1.0, 1.0, 10, 20, bwd_tmp_bytes=-20).bwd_tmp_bytes == -20
    with pytest.raises(ChainFormatError, match="'bwd_tmp_bytes' must be at least -20"):
        Stage("s", 1.0, 1.0, 10, 20, bwd_tmp_bytes=-21)


def test_refill_time_defaults_to_the_forward_and_round_trips_when_it_differs() -> None:
    data = sample_dict()
    data["stages"][0]["refill_s"] = 0.0015
    chain = Chain.from_dict(data)
    assert chain.stage(1).refill_s == 0.0015 and chain.stage(2).refill_s == 0.001
    written = chain.to_dict()
    assert written["stages"][0]["refill_s"] == 0.0015 and "refill_s" not in written["stages"][1]
    assert Chain.from_dict(written) == chain


def test_a_link_that_is_not_a_link_is_refused_naming_the_field() -> None:
    chain = Chain("one", 4, (Stage("s1", 1.0, 1.0, 4, 8),))
    with pytest.raises(ChainFormatError, match="field 'link' must be a Link"):
        chain.with_link((1e10, 1e10))
    assert chain.with_link(Link(1e10, 1e10)).link == Link(1e10, 1e10)
