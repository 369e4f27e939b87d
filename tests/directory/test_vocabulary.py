"""The control plane's tier order, batch limit and default class are the data plane's, defined once."""

from controlplane.directory.choices import DEFAULT_CLASS, MAX_BATCH, TIER_ORDER, Dtype, TierLevel
from controlplane.movements.choices import DEMOTION_ORDER
from controlplane.policies.specs import PolicySnapshot
from worker.dataplane import directory as protocol
from worker.dataplane import tier_names
from worker.dataplane.profile import KV_DTYPES


def test_tier_levels_are_the_data_planes_tiers_in_its_order():
    assert tuple(TierLevel) == TIER_ORDER
    assert tuple(TIER_ORDER) == tier_names.TIER_ORDER
    assert DEMOTION_ORDER == ("host", "disk", "remote")


def test_batch_limit_dtypes_and_default_class_are_shared():
    assert MAX_BATCH == protocol.MAX_BATCH
    assert tuple(Dtype.values) == KV_DTYPES
    assert PolicySnapshot(version=1, mode="", classes=(), tiers=()).class_of_namespace("any").name == DEFAULT_CLASS
