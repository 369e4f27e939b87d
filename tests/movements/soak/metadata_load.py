"""The soak test's metadata load, run in a process of its own: block registrations, lookups and
touches through the directory services at a steady rate, on a catalog node that holds no bytes
(so the load never shows up as a READY copy the invariants would read).

    manage.py shell -c "from tests.movements.soak.metadata_load import run; run(seconds=120, rate=200)"

Prints one JSON line of counts every ~10 s and a final one ({"final": true, ...})."""

from __future__ import annotations

import json
import random
import time
import uuid


def run(*, seconds: float, rate: float, node: str = "soak-catalog", namespace: str = "soak-catalog") -> dict:
    from controlplane.directory.models import ModelProfile
    from controlplane.directory.selectors import blocks_lookup
    from controlplane.directory.services import (
        blocks_register,
        blocks_touch,
        namespace_ensure,
        node_heartbeat,
    )
    from worker.dataplane.directory import BlockRegistration, BlockTouch

    profile = ModelProfile.objects.order_by("id").first()
    if profile is None:
        raise SystemExit("metadata load: no model profile yet (start a node first)")
    namespace_ensure(name=namespace)
    # A node with no tiers: the planner never plans for it, no reconcile or scrub runs on it.
    node_heartbeat(name=node, host="catalog", heartbeat_seconds=3600.0, tiers=[])
    keys: list[uuid.UUID] = []
    counts = {"registrations": 0, "lookups": 0, "touches": 0, "errors": 0}
    started = time.monotonic()
    reported = started
    done = 0
    while (now := time.monotonic()) - started < seconds:
        due = int((now - started) * rate)
        if done >= due:
            time.sleep(min(0.005, (done + 1 - due) / rate))
            continue
        kind = ("registrations", "lookups", "touches")[done % 3] if keys else "registrations"
        try:
            if kind == "registrations":
                key = uuid.uuid4()
                blocks_register(
                    registrations=[
                        BlockRegistration(
                            namespace=namespace,
                            model_key=profile.model_key,
                            prefix_key=key,
                            content_key=uuid.uuid4(),
                            position=16 * len(keys),
                            tokens=profile.block_tokens,
                            tier="host",
                            node=node,
                            nbytes=1,
                            checksum="0" * 32,
                        )
                    ],
                    source="soak",
                )
                keys.append(key)
            elif kind == "lookups":
                blocks_lookup(
                    namespace=namespace,
                    model_key=profile.model_key,
                    node=None,
                    prefix_keys=random.sample(keys, min(8, len(keys))),
                )
            else:
                blocks_touch(
                    touches=[
                        BlockTouch(namespace=namespace, model_key=profile.model_key, prefix_key=k)
                        for k in random.sample(keys, min(4, len(keys)))
                    ]
                )
            counts[kind] += 1
        except Exception as exc:  # noqa: BLE001 - counted and reported: the soak asserts there are none
            counts["errors"] += 1
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        done += 1
        if now - reported >= 10:
            reported = now
            print(json.dumps({**counts, "elapsed_s": round(now - started, 1)}), flush=True)
    summary = {**counts, "elapsed_s": round(time.monotonic() - started, 1), "final": True}
    print(json.dumps(summary), flush=True)
    return summary
