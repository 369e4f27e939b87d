"""The OpenAPI schema: valid, every directory endpoint in it, and fuzzed by schemathesis with no 5xx."""

from __future__ import annotations

import pytest
from django.core.management import call_command

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is a dev dependency of the schema fuzz")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

ENDPOINTS = [
    "/api/v1/namespaces/",
    "/api/v1/namespaces/{name}/",
    "/api/v1/model-profiles/",
    "/api/v1/model-profiles/{name}/",
    "/api/v1/blocks/",
    "/api/v1/blocks/{id}/",
    "/api/v1/blocks/lookup/",
    "/api/v1/blocks/register/",
    "/api/v1/blocks/purge/",
    "/api/v1/nodes/",
    "/api/v1/nodes/{name}/",
]


def test_schema_validates_without_warnings(tmp_path):
    out = tmp_path / "schema.yaml"
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(out))
    text = out.read_text()
    for path in ENDPOINTS:
        assert f"  {path}:" in text, path


@pytest.fixture
def wsgi_app(db):
    """Django's WSGI app inside the test's transaction: like the test client, it must not close the
    database connection at the end of each request."""
    from django.core.signals import request_finished, request_started
    from django.core.wsgi import get_wsgi_application
    from django.db import close_old_connections

    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield get_wsgi_application()
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


@pytest.fixture
def api_schema(wsgi_app, registration):
    from controlplane.directory.services import blocks_register

    blocks_register(registrations=[registration(position=16 * i) for i in range(4)])
    return schemathesis.openapi.from_wsgi("/api/schema/?format=json", wsgi_app)


@pytest.fixture
def admin_token(db):
    from rest_framework.authtoken.models import Token

    from tests.directory.conftest import user_with_role

    return Token.objects.create(user=user_with_role("superuser")).key


@pytest.mark.slow
def test_no_server_errors(api_schema, admin_token, profile):
    """Every operation, fuzzed from its schema with an admin token; any 5xx fails. (Driven by hand:
    schemathesis' pytest fixture loader does not run under pytest 9.)"""
    headers = {"Authorization": f"Token {admin_token}"}
    known = {"namespace": "tenant-a", "model_key": str(profile.model_key), "node": "gpu-0"}
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= set(ENDPOINTS)
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
        )
        def fuzz(case):
            # Random names almost never exist, so most bodies would stop at "unknown namespace";
            # pointing them at real ones lets the rest of the generated body reach the database.
            if isinstance(case.body, dict) and isinstance(case.body.get("namespace"), str):
                case.body.update(known)
            case.call_and_validate(headers=headers, checks=[not_a_server_error])

        fuzz()
