"""Strata control plane: the Django project that decides and records what is where."""
