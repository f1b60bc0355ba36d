"""``OFFREMAT_TEST_DEVICE=cuda`` runs the CPU suite on a GPU: tensors and modules that a test
creates without naming a device land there (``torch.set_default_device``). Tests that name
the CPU, or assert CPU-only facts (the dispatch-mode tracker, bitwise CPU kernels), may then
fail for that reason alone; read such failures before counting them against the executor."""

import os

import torch

_DEVICE = os.environ.get("OFFREMAT_TEST_DEVICE")
if _DEVICE:
    torch.set_default_device(_DEVICE)
