"""Local eviction: room in a full host or disk tier made on the node at write-back, by the tier's policy."""
