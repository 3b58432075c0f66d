import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Numerics tests run on every device; without a GPU the CUDA cases show as skipped, not missing.
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
