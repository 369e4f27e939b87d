"""/livez, /readyz and /metrics against the real PostgreSQL and Redis."""

import pytest


@pytest.mark.django_db
def test_livez(client):
    response = client.get("/livez")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


@pytest.mark.django_db
def test_readyz_ok_with_real_services(client):
    response = client.get("/readyz")
    assert response.status_code == 200, response.content
    assert response.json() == {"status": "ok", "checks": ["database", "migrations", "redis"]}


@pytest.mark.django_db
def test_readyz_503_names_redis_when_unreachable(client, settings, tmp_path):
    settings.STRATA_REDIS_URL = f"unix://{tmp_path}/no-such-redis.sock"
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable"
    assert set(body["failed"]) == {"redis"}
    assert "redis unreachable" in body["failed"]["redis"]
    metrics = client.get("/metrics").content.decode()
    assert 'strata_readiness_failures_total{check="redis"}' in metrics


@pytest.mark.django_db
def test_metrics_exports_nodes_from_the_directory(client):
    from controlplane.directory.services import TierReport, node_heartbeat

    node_heartbeat(
        name="gpu-m",
        host="h",
        heartbeat_seconds=5.0,
        tiers=[TierReport(tier="host", capacity_bytes=1000, used_bytes=250)],
    )
    response = client.get("/metrics")
    assert response.status_code == 200
    text = response.content.decode()
    assert 'strata_node_up{node="gpu-m",state="up"} 1.0' in text
    assert 'strata_tier_used_bytes{node="gpu-m",tier="host"} 250.0' in text
    assert 'strata_tier_capacity_bytes{node="gpu-m",tier="host"} 1000.0' in text
    assert 'strata_node_heartbeats_total{node="gpu-m"} 1.0' in text
