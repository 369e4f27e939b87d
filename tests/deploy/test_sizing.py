"""The /dev/shm rule the deployment files are checked against holds for a real host pool."""

import pytest
import torch

from tests.deploy.sizing import (
    GIB,
    MIN_BLOCK_BYTES,
    POOL_METADATA_SHARE,
    compose_size_at_least,
    kubernetes_quantity,
    shm_bytes_needed,
    strata_size,
)
from worker.dataplane.layout import BlockLayout
from worker.dataplane.tiers.host.tier import HostTier


@pytest.mark.parametrize("layers", [1, 32, 128])
def test_a_pools_metadata_stays_under_its_share(tmp_path, layers):
    # The smallest block the rule covers, cut in as many layers as a served model has.
    layout = BlockLayout(
        layers=layers, kv_heads=1, head_dim=8, block_tokens=MIN_BLOCK_BYTES // (layers * 32), dtype=torch.float16
    )
    assert layout.block_bytes == MIN_BLOCK_BYTES
    capacity = 64 * MIN_BLOCK_BYTES
    tier = HostTier(layout=layout, capacity_bytes=capacity, pool_name="sizing", shm_dir=tmp_path, pin=False)
    try:
        pool_file = (tmp_path / "sizing").stat().st_size
        assert tier.usage().capacity_bytes == capacity
    finally:
        tier.close()
    assert capacity < pool_file <= capacity * (1 + POOL_METADATA_SHARE)


def test_the_size_notations():
    assert strata_size("48GiB") == 48 * GIB
    assert compose_size_at_least("64gb") == 64 * 1000**3
    assert compose_size_at_least("512m") == 512 * 1000**2
    assert kubernetes_quantity("64Gi") == 64 * GIB
    assert kubernetes_quantity("500M") == 500 * 1000**2
    assert shm_bytes_needed(48 * GIB) == int(48 * GIB * 1.02) + GIB
