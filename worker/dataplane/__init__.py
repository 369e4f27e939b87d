"""Strata's data plane: block layout, fingerprints, checksums and the tiered block store (no Django, no Celery)."""
