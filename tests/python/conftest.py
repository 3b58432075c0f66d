import datetime

import pytest
import torch
import torch.distributed as dist

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Numerics tests run on every device; without a GPU the CUDA cases show as skipped, not missing.
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


@pytest.fixture
def world1():
    """A Gloo group of one rank in this process; destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        import gc

        gc.collect()  # our communicators hold the group: drop them before it is destroyed
        dist.destroy_process_group()
