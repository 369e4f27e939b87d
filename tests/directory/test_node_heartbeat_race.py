"""Two processes of a new node reporting at the same moment: both heartbeats are recorded, on one row."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from controlplane.directory.models import Node
from controlplane.directory.services import TierReport, node_heartbeat

pytestmark = pytest.mark.django_db(transaction=True)


def test_concurrent_first_heartbeats_of_one_node_make_one_row():
    for attempt in range(5):
        name = f"race-{attempt}"
        start = threading.Barrier(4)
        errors: list[BaseException] = []

        def beat(name: str = name, start: threading.Barrier = start, errors: list[BaseException] = errors) -> None:
            try:
                start.wait()
                node_heartbeat(
                    name=name,
                    host="h",
                    heartbeat_seconds=5.0,
                    tiers=[TierReport(tier="host", capacity_bytes=100, used_bytes=1)],
                )
            except BaseException as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)
            finally:
                connection.close()

        threads = [threading.Thread(target=beat) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert errors == []
        node = Node.objects.get(name=name)
        assert node.heartbeats == 4 and node.state == "up"
        assert list(node.tiers.values_list("tier", "used_bytes")) == [("host", 1)]
