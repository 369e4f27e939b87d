"""Strata control plane: the Django project that decides and records what is where."""

__version__ = "0.1.0"
"""The version of the `strata-kv` distribution (pyproject reads it from here): the REST API's
schema and every /metrics report it."""
