"""Tests of worker.dataplane (Django-free): real files, real Redis, real processes."""
