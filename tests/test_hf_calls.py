"""Hugging Face calls in a training step: what each is given when the blocks run under a plan.

Outputs recorded per block (hidden states, attentions, router logits) and a key-value cache
cannot be what plain autograd gives, so they are refused; the hooks Hugging Face installs to
record them, which record nothing otherwise, do not stop later training. Oracle: plain
autograd, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offremat
from offremat import NotAChainError
from offremat.measure import StepMemory
from tests import model_zoo as zoo
from tests.oracles import step_within_budget

pytest.importorskip("transformers")

IDS = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(0))
BATCH = {"input_ids": IDS, "labels": IDS}


def train_step(model) -> torch.Tensor:
    for parameter in model.parameters():
        parameter.grad = None
    loss = model(**BATCH).loss
    loss.backward()
    return loss.detach()


def test_hidden_states_asked_for_without_gradients_leave_training_as_it_was() -> None:
    # The first such call installs Hugging Face's recording hooks on every block, for good:
    # they refused every later training step ("has forward hooks").
    torch.manual_seed(0)
    model = zoo.llama().train()
    reference = copy.deepcopy(model)
    om = offremat.optimize(model, BATCH, budget=0.5)
    for network in (om, reference):
        train_step(network)
        network.eval()
        with torch.no_grad():
            states = network(input_ids=IDS, output_hidden_states=True).hidden_states
        assert len(states) == model.config.num_hidden_layers + 1
        network.train()
    assert model.model.layers[0]._forward_hooks  # the recording hook is there
    assert torch.equal(train_step(om), train_step(reference))
    assert om.cache_info()["misses"] == 0  # and planned nothing again
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)


def test_a_key_value_cache_in_a_training_step_is_refused() -> None:
    # Chunked training carried an empty cache on: the second chunk's loss was 4.5710 where
    # plain autograd's, attending to the first chunk, was 4.6249.
    torch.manual_seed(0)
    model = zoo.llama().train()
    om = offremat.optimize(model, BATCH, budget=0.5)
    with pytest.raises(NotAChainError, match=r"key-value cache \(use_cache=True\)"):
        om(**BATCH, use_cache=True)
    first = om(input_ids=IDS[:, :16], labels=IDS[:, :16])  # use_cache from the config
    with pytest.raises(NotAChainError, match=r"key-value cache \(past_key_values\)"):
        om(input_ids=IDS[:, 16:], labels=IDS[:, 16:], past_key_values=first.past_key_values)
    om(**BATCH, use_cache=False).loss.backward()


def test_router_logits_for_a_load_balancing_loss_are_refused_by_name() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        num_hidden_layers=4,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        num_local_experts=4,
        num_experts_per_tok=2,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    om = offremat.optimize(MixtralForCausalLM(config).train(), BATCH, budget=0.5)
    with pytest.raises(NotAChainError, match="output_router_logits=True"):
        om(**BATCH, output_router_logits=True)
    # Set when optimize profiles the model, it ended in a bare IndexError inside the model.
    with pytest.raises(NotAChainError, match="output_router_logits=True"):
        offremat.optimize(
            MixtralForCausalLM(config).train(), {**BATCH, "output_router_logits": True}
        )
    config.output_router_logits = True
    with pytest.raises(NotAChainError, match="output_router_logits=True"):
        offremat.optimize(MixtralForCausalLM(config).train(), BATCH, budget=0.5)


def test_hidden_states_asked_for_by_the_config_are_refused_by_name_at_optimize() -> None:
    # It was refused as no chain, with advice to name the blocks, never naming the flag.
    model = zoo.llama(output_hidden_states=True).train()
    with pytest.raises(NotAChainError, match="output_hidden_states=True"):
        offremat.optimize(model, BATCH, budget=0.5)
    with pytest.raises(NotAChainError, match=r"key-value cache \(use_cache=True\)"):
        offremat.optimize(zoo.llama().train(), {**BATCH, "use_cache": True}, budget=0.5)


def test_optimize_and_new_shapes_leave_the_caller_s_graph_and_gradients_alone() -> None:
    # Measuring the code around the blocks ran its backward on the caller's batch: it left
    # zeros in the .grad of inputs_embeds that required grad, and through embeddings computed
    # by the caller it freed the caller's graph, so that a step on a new shape failed with
    # autograd's "backward through the graph a second time".
    torch.manual_seed(0)
    model = zoo.llama().train()
    embeds = torch.randn(*IDS.shape, 64, requires_grad=True)
    offremat.optimize(model, {"inputs_embeds": embeds, "labels": IDS}, budget=0.5)
    assert embeds.grad is None
    outer = nn.Embedding(96, 64)  # the caller's own, outside the model
    om = offremat.optimize(model, {"inputs_embeds": outer(IDS), "labels": IDS}, budget=0.5)
    assert outer.weight.grad is None
    reference = copy.deepcopy(model)
    longer = torch.cat([IDS, IDS], dim=1)
    om(inputs_embeds=outer(longer), labels=longer).loss.backward()
    mine, outer.weight.grad = outer.weight.grad, None
    reference(inputs_embeds=outer(longer), labels=longer).loss.backward()
    assert torch.equal(mine, outer.weight.grad)


def test_hooks_a_first_call_installs_are_left_to_the_model_as_it_found_them() -> None:
    """LLaVA asks its vision tower for hidden states, which Hugging Face records with hooks
    it installs on the first call, marking the tower with an attribute. optimize's runs put
    the model's attributes back but kept the hooks: the next call installed them twice, read
    a None among the hidden states, and optimize crashed inside Hugging Face's code, leaving
    the model itself broken."""
    model, batch = zoo.llava()
    reference = copy.deepcopy(model)
    optimized = offremat.optimize(model, batch, budget=0.8)
    assert optimized.chain.metadata["blocks"][0].startswith("model.language_model.layers")
    with torch.no_grad():
        assert torch.equal(model(**batch).loss, reference(**batch).loss)
    for _ in range(2):
        step_within_budget(optimized, model, reference, **batch)
    assert optimized.cache_info()["misses"] == 0


@pytest.mark.parametrize("budget", [0.8, 1.0])
def test_one_layer_used_as_every_stage_fits_its_budget(budget: float) -> None:
    """ALBERT calls one layer module as each layer: its parameters' gradient sums come into
    being in the last stage's backward, and were counted only after it (1.008 times the
    budget, at keep-all too)."""
    model = zoo.albert()
    reference = copy.deepcopy(model)
    ids = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": torch.tensor([0, 2])}
    optimized = offremat.optimize(model, batch, budget=budget)
    assert len(set(optimized.chain.metadata["blocks"])) == 1 < optimized.chain.length
    step_within_budget(optimized, model, reference, **batch)


def _alternating(kind: str) -> nn.Module:
    """A small model whose layers alternate sliding-window and full attention."""
    import transformers as hf

    shape = {"vocab_size": 96, "hidden_size": 32, "num_attention_heads": 4}
    if kind == "gemma2":
        config = hf.Gemma2Config(
            **shape,
            num_hidden_layers=4,
            intermediate_size=64,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=8,
        )
        return hf.Gemma2ForCausalLM(config)
    if kind == "gemma3":
        config = hf.Gemma3TextConfig(
            **shape,
            num_hidden_layers=8,
            intermediate_size=64,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=8,
        )
        return hf.Gemma3ForCausalLM(config)
    if kind == "gpt-oss":
        config = hf.GptOssConfig(
            **shape,
            num_hidden_layers=4,
            intermediate_size=32,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
        )
        return hf.GptOssForCausalLM(config)
    if kind == "qwen2":  # sliding windows in the first max_window_layers layers only
        config = hf.Qwen2Config(
            **shape,
            num_hidden_layers=4,
            intermediate_size=64,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=2,
        )
        return hf.Qwen2ForCausalLM(config)
    config = hf.ModernBertConfig(
        **shape,
        num_hidden_layers=6,
        intermediate_size=64,
        global_attn_every_n_layers=3,
        local_attention=8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    )
    return hf.ModernBertForMaskedLM(config)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "gpt-oss", "qwen2", "modernbert"])
def test_layers_alternating_kinds_of_attention_train_within_budget_as_plain_autograd(
    kind: str,
) -> None:
    """Gemma-2 and -3, GPT-OSS, Qwen2 with sliding windows and ModernBERT give their layers
    a mask per kind of attention, in turns: they were refused (every block of a chain took
    the same side arguments). Each kind's mask is now a side input of its own, every layer
    of the run in the chain, on a sequence longer than the sliding window and on a shorter
    one (another plan)."""
    torch.manual_seed(0)
    model = _alternating(kind).train()
    reference = copy.deepcopy(model)
    optimized = offremat.optimize(model, BATCH, budget=0.6)
    layers = model.config.num_hidden_layers
    assert len(optimized.chain.metadata["blocks"]) >= layers
    for ids in (IDS, IDS[:, :6].contiguous()):
        step_within_budget(optimized, model, reference, input_ids=ids, labels=ids)


@pytest.mark.parametrize("kind", ["qwen2", "gemma2"])
def test_layers_of_two_kinds_optimized_on_a_sequence_shorter_than_the_window(kind: str) -> None:
    """Under sdpa, a sequence no longer than the sliding window gives both kinds of layer no
    mask: one group of side inputs was found, and a longer step was refused (Qwen2, Cohere2,
    Exaone4; a review). The layers' kinds (config.layer_types) now group them."""
    torch.manual_seed(0)
    model = _alternating(kind).train()
    reference = copy.deepcopy(model)
    short = IDS[:, :6].contiguous()
    with StepMemory("cpu", inputs=BATCH) as plain:
        copy.deepcopy(model)(**BATCH).loss.backward()
    budget = int(0.8 * plain.peak_bytes)
    optimized = offremat.optimize(model, {"input_ids": short, "labels": short}, budget=budget)
    for ids in (IDS, short):
        step_within_budget(optimized, model, reference, input_ids=ids, labels=ids)


def test_the_key_value_cache_warning_is_said_once_per_model(caplog) -> None:
    # Each new shape's profile found the cache again: a new user read the warning five times
    # in one run (a trial).
    import logging

    torch.manual_seed(0)
    model = zoo.llama().train()
    model.config.use_cache = True
    with caplog.at_level(logging.WARNING, logger="offremat"):
        om = offremat.optimize(model, BATCH, budget=0.9)
        for length in (32, 24, 16):
            om(input_ids=IDS[:, :length], labels=IDS[:, :length]).loss.backward()
    said = [r for r in caplog.records if "key-value cache is not filled" in r.getMessage()]
    assert om.cache_info()["misses"] >= 2 and len(said) == 1
