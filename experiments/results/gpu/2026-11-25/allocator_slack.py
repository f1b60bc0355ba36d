# The script that made allocator_slack*.log, kept as it ran (from the repository root:
# python3 experiments/results/gpu/2026-11-25/allocator_slack.py, once as is and once with
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True). A scratch diagnostic, not part of the suite.
"""Which ops make storages the allocator holds but the dispatch tracker never sees?"""
import sys, dataclasses, contextlib
import torch
from torch.nn.attention import sdpa_kernel, SDPBackend
sys.path.insert(0, "."); sys.path.insert(0, "experiments")
from gpu_check_parts import GPT
from offremat.models import build_gpt, gpt_batch
from offremat.measure import LiveStorageTracker

class Gap(LiveStorageTracker):
    def __init__(self, base, verbose):
        super().__init__(); self.base = base; self.last = 0; self.n = 0; self.verbose = verbose; self.peak_gap = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.n += 1
        live = [r() for r in self._live.values() if r() is not None]
        rounded = sum((s.nbytes() + 511) // 512 * 512 for s in live)
        gap = torch.cuda.memory_allocated() - self.base - rounded
        self.peak_gap = max(self.peak_gap, gap)
        if self.verbose and abs(gap - self.last) > 65536:
            outs = out if isinstance(out, (tuple, list)) else [out]
            desc = [(tuple(o.shape), str(o.dtype).replace("torch.", ""), o.untyped_storage().nbytes()) for o in outs if isinstance(o, torch.Tensor)]
            print(f"  op {self.n} {func} gap {self.last}->{gap} ({gap - self.last:+d}) outs {desc}")
        self.last = gap
        return out

def run(label, dropout, backend, autocast, verbose=False):
    cfg = dataclasses.replace(GPT, dropout=dropout)
    torch.manual_seed(0)
    model = build_gpt(cfg).cuda()
    batch = gpt_batch(cfg, 8, device="cuda")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    def step(mode=None):
        ctx = sdpa_kernel(backend) if backend else contextlib.nullcontext()
        with ctx, (torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()):
            loss = model(batch)
        loss.backward()
    step(); step()
    torch.cuda.synchronize(); base = torch.cuda.memory_allocated()
    g = Gap(base, verbose)
    with g:
        step()
    print(f"{label}: peak gap {g.peak_gap} final gap {g.last}")
    del model

import os; print("alloc conf", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
run("bf16 dropout0.1 default (verbose)", 0.1, None, True, verbose=True)
run("bf16 dropout0", 0.0, None, True)
for b in (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
    try:
        run(f"bf16 dropout0.1 {b}", 0.1, b, True)
    except Exception as e:
        print(b, "failed", type(e).__name__, str(e)[:100])
run("fp32 dropout0.1 default", 0.1, None, False)
