"""Derive the example chains shipped in ``offremat/examples/`` from activation-size and FLOP
formulas, so that every number in them can be reproduced and checked.

    python experiments/make_example_chains.py            # rewrite offremat/examples/*.json
    python experiments/make_example_chains.py --out DIR  # write them elsewhere

Formulas and assumptions are written into each chain's "metadata". Sizes are bytes; a 16-bit
element is 2 bytes. Compute times are FLOPs over an assumed sustained FLOP rate; the cheap
memory-bound stages (embedding) are bytes moved over an assumed HBM bandwidth. Backward costs
twice the forward's FLOPs. Sources: Korthikanti et al., "Reducing activation recomputation in
large transformer models" (2022) for the GPT block; He et al., "Deep residual learning" (2016)
for the ResNet-50 layout.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from solvers.chain import Chain, Link, Stage

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "offremat" / "examples"
HALF = 2  # bytes of a 16-bit element
FLOAT = 4
INDEX = 8
LOSS_BYTES = FLOAT  # the scalar fp32 loss that ends every chain


def _stage(name: str, fwd_flops: float, rate: float, **sizes: int) -> Stage:
    return Stage(name=name, fwd_s=fwd_flops / rate, bwd_s=2 * fwd_flops / rate, **sizes)


def _memory_bound(name: str, moved_bytes: int, bandwidth: float, **sizes: int) -> Stage:
    return Stage(
        name=name, fwd_s=moved_bytes / bandwidth, bwd_s=2 * moved_bytes / bandwidth, **sizes
    )


def _lm_head(s: int, b: int, h: int, vocab: int, rate: float) -> Stage:
    return _stage(
        "head",
        2 * s * b * h * vocab,
        rate,
        out_bytes=LOSS_BYTES,
        saved_bytes=HALF * s * b * h + FLOAT * s * b * vocab + LOSS_BYTES,
        fwd_tmp_bytes=HALF * s * b * vocab,
        bwd_tmp_bytes=FLOAT * s * b * vocab,
    )


_LM_HEAD_FORMULAS = {
    "head.saved_bytes": "2·s·b·h (normed input of the LM head) + 4·s·b·V (fp32 logits kept by "
    "cross-entropy) + 4 (loss)",
    "head.fwd_tmp_bytes": "2·s·b·V (16-bit logits before the fp32 upcast)",
    "head.bwd_tmp_bytes": "4·s·b·V (fp32 gradient of the logits)",
    "head.flops": "2·s·b·h·V",
    "out_bytes of head": "4: the scalar fp32 loss",
}


def gpt2_small() -> Chain:
    """GPT-2-small-shaped: 12 blocks, h=768, 12 heads, seq 1024, batch 8, bf16, no flash."""
    layers, h, heads, s, b, vocab = 12, 768, 12, 1024, 8, 50257
    rate, hbm, link = 125e12, 1.5e12, 25e9
    hidden = HALF * s * b * h
    stages = [
        _memory_bound(
            "embed",
            2 * hidden,
            hbm,
            out_bytes=hidden,
            saved_bytes=hidden + s * b * h,
        )
    ]
    for k in range(layers):
        stages.append(
            _stage(
                f"block{k}",
                24 * b * s * h * h + 4 * b * s * s * h,
                rate,
                out_bytes=hidden,
                saved_bytes=s * b * h * 34 + 5 * heads * s * s * b,
                fwd_tmp_bytes=HALF * heads * s * s * b,
                bwd_tmp_bytes=2 * HALF * heads * s * s * b,
            )
        )
    stages.append(_lm_head(s, b, h, vocab, rate))
    return Chain(
        name="gpt2-small",
        input_bytes=INDEX * s * b,
        stages=tuple(stages),
        link=Link(link, link),
        metadata={
            "generator": "experiments/make_example_chains.py",
            "model": "GPT-2 small: embedding, 12 pre-LN transformer blocks, LM head + loss",
            "shape": {
                "layers": layers,
                "h": h,
                "heads": heads,
                "seq": s,
                "batch": b,
                "vocab": vocab,
            },
            "dtype": "bf16 activations, int64 token ids, fp32 loss",
            "assumptions": {
                "flop_rate_per_s": rate,
                "hbm_bytes_per_s": hbm,
                "link_bytes_per_s": link,
                "attention": "plain softmax attention (no flash): the s² scores are stored",
                "backward": "twice the forward FLOPs",
            },
            "formulas": {
                "input_bytes": "8·s·b (int64 token ids)",
                "out_bytes": "2·s·b·h",
                "embed.saved_bytes": "2·s·b·h (output) + s·b·h (1-byte dropout mask)",
                "embed.time": "fwd = 2·(2·s·b·h) / HBM bandwidth",
                "block.saved_bytes": "s·b·h·(34 + 5·a·s/h) (Korthikanti et al. 2022, 16-bit); "
                "their count includes the block input but not its output, both 2·s·b·h, so it "
                "equals x̄ = everything but the input, output included",
                "block.fwd_tmp_bytes": "2·a·s²·b (pre-softmax scores, freed by softmax)",
                "block.bwd_tmp_bytes": "4·a·s²·b (gradients of the scores and probabilities)",
                "block.flops": "24·b·s·h² + 4·b·s²·h",
                **_LM_HEAD_FORMULAS,
            },
        },
    )


def llama_7b(fused_swiglu: bool = False) -> Chain:
    """Llama-7B-shaped (the largest example): 32 blocks, h=4096, seq 4096, batch 1, bf16, flash.

    Eager PyTorch keeps four f-wide tensors per SwiGLU (gate, up, silu(gate), their product);
    a fused SwiGLU kernel keeps only gate and up, which ``fused_swiglu`` models.
    """
    layers, h, heads, ffn, s, b, vocab = 32, 4096, 32, 11008, 4096, 1, 32000
    swiglu_tensors = 2 if fused_swiglu else 4
    rate, hbm, link = 400e12, 3e12, 50e9
    hidden = HALF * s * b * h
    stages = [
        _memory_bound("embed", 2 * hidden, hbm, out_bytes=hidden, saved_bytes=hidden),
    ]
    for k in range(layers):
        stages.append(
            _stage(
                f"block{k}",
                2 * s * b * (4 * h * h + 3 * h * ffn) + 4 * s * s * b * h,
                rate,
                out_bytes=hidden,
                saved_bytes=16 * s * b * h
                + HALF * swiglu_tensors * s * b * ffn
                + FLOAT * heads * s * b,
                fwd_tmp_bytes=HALF * s * b * ffn,
                bwd_tmp_bytes=2 * HALF * s * b * ffn,
            )
        )
    stages.append(_lm_head(s, b, h, vocab, rate))
    return Chain(
        name="llama-7b-fused-swiglu" if fused_swiglu else "llama-7b",
        input_bytes=INDEX * s * b,
        stages=tuple(stages),
        link=Link(link, link),
        metadata={
            "generator": "experiments/make_example_chains.py",
            "model": "Llama-7B: embedding, 32 blocks (RMSNorm, RoPE, flash attention, SwiGLU), "
            "LM head + loss",
            "shape": {
                "layers": layers,
                "h": h,
                "heads": heads,
                "ffn": ffn,
                "seq": s,
                "batch": b,
                "vocab": vocab,
            },
            "dtype": "bf16 activations, int64 token ids, fp32 loss",
            "assumptions": {
                "flop_rate_per_s": rate,
                "hbm_bytes_per_s": hbm,
                "link_bytes_per_s": link,
                "attention": "flash attention: no s² tensor is stored, only a per-row "
                "fp32 log-sum-exp",
                "dropout": "none",
                "backward": "twice the forward FLOPs",
            },
            "formulas": {
                "input_bytes": "8·s·b (int64 token ids)",
                "out_bytes": "2·s·b·h",
                "embed.saved_bytes": "2·s·b·h (the output only)",
                "embed.time": "fwd = 2·(2·s·b·h) / HBM bandwidth",
                "block.saved_bytes": (
                    "16·s·b·h + 4·s·b·f + 4·a·s·b, counting 16-bit tensors autograd keeps: "
                    "normed input (2sbh), q, k, v (6sbh), attention output (2sbh), mid residual "
                    "and its norm (4sbh), output a_i (2sbh); a fused SwiGLU keeps gate and up "
                    "(4sbf); fp32 log-sum-exp (4asb). The block input is not counted"
                    if fused_swiglu
                    else "16·s·b·h + 8·s·b·f + 4·a·s·b, counting 16-bit tensors autograd "
                    "keeps: normed input (2sbh), q, k, v (6sbh), attention output (2sbh), mid "
                    "residual and its norm (4sbh), output a_i (2sbh); SwiGLU gate, up, "
                    "silu(gate) and their product (8sbf); fp32 log-sum-exp (4asb). The block "
                    "input is not counted (it is a_{i-1})"
                ),
                "block.fwd_tmp_bytes": "2·s·b·f (one f-wide 16-bit intermediate)",
                "block.bwd_tmp_bytes": "4·s·b·f (gradients of the two f-wide branches)",
                "block.flops": "2·s·b·(4·h² + 3·h·f) + 4·s²·b·h",
                **_LM_HEAD_FORMULAS,
            },
        },
    )


def _bottleneck(
    name: str, b: int, spatial_in: int, c_in: int, width: int, stride: int, rate: float
) -> Stage:
    c_out = 4 * width
    spatial_out = spatial_in // stride
    area_in, area_out = spatial_in * spatial_in, spatial_out * spatial_out
    projection = stride != 1 or c_in != c_out
    flops = (
        2
        * b
        * (
            area_in * c_in * width
            + area_out * 9 * width * width
            + area_out * width * c_out
            + (area_out * c_in * c_out if projection else 0)
        )
    )
    saved = (
        HALF
        * b
        * (2 * width * area_in + 2 * width * area_out + (2 + projection) * c_out * area_out)
    )
    largest = HALF * b * max(width * area_in, c_out * area_out)
    return _stage(
        name,
        flops,
        rate,
        out_bytes=HALF * b * c_out * area_out,
        saved_bytes=saved,
        bwd_tmp_bytes=2 * largest,
    )


def resnet50() -> Chain:
    """ResNet-50-shaped: stem, 16 bottleneck blocks in four stages, head; batch 64, 224², fp16."""
    b, image, classes = 64, 224, 1000
    rate, hbm, link = 60e12, 1.5e12, 25e9
    stem_area, pooled_area = 112 * 112, 56 * 56
    stages = [
        _stage(
            "stem",
            2 * b * stem_area * 7 * 7 * 3 * 64,
            rate,
            out_bytes=HALF * b * 64 * pooled_area,
            saved_bytes=2 * HALF * b * 64 * stem_area
            + INDEX * b * 64 * pooled_area
            + HALF * b * 64 * pooled_area,
            bwd_tmp_bytes=2 * HALF * b * 64 * stem_area,
        )
    ]
    spatial, channels = 56, 64
    for group, (blocks, width, stride) in enumerate(
        ((3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2)), start=1
    ):
        for k in range(blocks):
            step = stride if k == 0 else 1
            stages.append(_bottleneck(f"layer{group}.{k}", b, spatial, channels, width, step, rate))
            spatial, channels = spatial // step, 4 * width
    head_read = HALF * b * channels * spatial * spatial
    stages.append(
        Stage(
            name="head",
            fwd_s=head_read / hbm + 2 * b * channels * classes / rate,
            bwd_s=2 * (head_read / hbm + 2 * b * channels * classes / rate),
            out_bytes=LOSS_BYTES,
            saved_bytes=HALF * b * channels + FLOAT * b * classes + LOSS_BYTES,
        )
    )
    return Chain(
        name="resnet50",
        input_bytes=HALF * b * 3 * image * image,
        stages=tuple(stages),
        link=Link(link, link),
        metadata={
            "generator": "experiments/make_example_chains.py",
            "model": "ResNet-50 (v1.5, stride on the 3×3 conv): stem, 3+4+6+3 bottlenecks, "
            "average pool + fc + loss",
            "shape": {"batch": b, "image": image, "classes": classes},
            "dtype": "fp16 activations, fp32 logits and loss",
            "assumptions": {
                "flop_rate_per_s": rate,
                "hbm_bytes_per_s": hbm,
                "link_bytes_per_s": link,
                "relu": "in place, so a BN output and its ReLU share one buffer",
                "batchnorm": "per-channel statistics are negligible and not counted",
                "backward": "twice the forward FLOPs",
            },
            "formulas": {
                "input_bytes": "2·b·3·224²",
                "stem.saved_bytes": "2·b·64·112² ×2 (conv output, ReLU output) + "
                "8·b·64·56² (max-pool int64 indices) + 2·b·64·56² (output)",
                "stem.flops": "2·b·112²·(7·7·3)·64",
                "block.saved_bytes": "2·b·(2·w·H_in² + 2·w·H_out² + (2 + p)·4w·H_out²): conv1 "
                "and ReLU1 outputs, conv2 and ReLU2 outputs, conv3 output and the block output, "
                "plus the projection conv output when p = 1 (first block of each group)",
                "block.bwd_tmp_bytes": "2 × the largest 16-bit tensor of the block (two "
                "gradient buffers alive at once)",
                "block.flops": "2·b·(H_in²·c_in·w + H_out²·9·w² + H_out²·w·4w + p·H_out²·c_in·4w)",
                "head.saved_bytes": "2·b·2048 (pooled fc input) + 4·b·1000 (fp32 logits) + 4",
                "head.time": "read of the final feature map over HBM + 2·b·2048·1000 FLOPs",
            },
        },
    )


EXAMPLES = {
    "transformer": gpt2_small,
    "cnn": resnet50,
    "llama7b": llama_7b,
    "llama7b-fused": lambda: llama_7b(fused_swiglu=True),
}


def main(argv: list[str] | None = None) -> int:
    """Write every example chain as ``<name>.json`` in ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=EXAMPLES_DIR, help="output directory")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, build in EXAMPLES.items():
        chain = build()
        chain.save(args.out / f"{name}.json")
        print(f"{args.out / f'{name}.json'}: {chain.length} stages")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
