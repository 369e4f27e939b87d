"""Strata data plane: blocks, fingerprints, tiers and loading; free of Django and Celery."""
