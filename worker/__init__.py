"""Strata node side: the data plane library, the node runtime and its Celery tasks."""
