"""The directory: nodes and, per block, its fingerprint, placements and lifecycle."""
