"""The four storage tiers of a node behind one interface (see `base.Tier`)."""

from worker.dataplane.tiers.base import PutResult, ReadResult, Tier, TierUsage

__all__ = ["PutResult", "ReadResult", "Tier", "TierUsage"]
