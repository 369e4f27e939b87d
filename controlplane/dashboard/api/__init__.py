"""JSON views the dashboard pages read: the overview snapshot, cache counters, request timelines."""
