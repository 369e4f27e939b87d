"""The OpenAPI schema: valid, every directory endpoint in it, and every operation fuzzed by
schemathesis with an operator's token and a viewer's: no 5xx, and every 4xx says what was wrong
(a 400 by the fields it names)."""

from __future__ import annotations

import re

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


BODY_LEVEL = {"detail", "non_field_errors"}
"""Keys of a 4xx body about the request as a whole rather than one field."""


def client_errors_name_the_problem(ctx, response, case) -> None:  # noqa: ANN001 - schemathesis' check signature
    """A 4xx is a JSON object saying why: "detail", or for a 400 the fields it names, each one a
    field of the request (path, query or body)."""
    if not 400 <= response.status_code < 500:
        return
    label = f"{case.method} {case.formatted_path} -> {response.status_code}"
    body = response.json()
    assert isinstance(body, dict) and body, f"{label}: no reason given: {response.text[:200]}"
    if response.status_code != 400:
        assert "detail" in body, f"{label}: {body}"
        return
    fields = set(case.path_parameters or {}) | set(case.query or {})
    fields |= set(case.body) if isinstance(case.body, dict) else set()

    def named(key: str) -> bool:
        # A field of the request, the request as a whole, a field the request left out, or a
        # path into a nested value ("overrides.tiers[0].algorithm") that its message starts with.
        head = re.split(r"[.\[]", key, maxsplit=1)[0]
        messages = body[key] if isinstance(body[key], list) else [body[key]]
        told = all(str(m).startswith(key) or "required" in str(m) for m in messages)
        return bool(key) and (key in BODY_LEVEL or head in fields or told)

    unnamed = [key for key in body if not named(key)]
    assert not unnamed, f"{label}: names {unnamed}, not fields of the request {sorted(fields)}: {body}"


@pytest.mark.slow
@pytest.mark.parametrize(("role", "examples"), [("operator", 40), ("viewer", 20)])
def test_no_server_errors(api_schema, profile, role, examples):
    """Every operation, fuzzed from its schema with a role's token; any 5xx fails, and so does a
    4xx that does not say what was wrong. (Driven by hand: schemathesis' pytest fixture loader
    does not run under pytest 9.)"""
    from rest_framework.authtoken.models import Token

    from tests.directory.conftest import user_with_role

    headers = {"Authorization": f"Token {Token.objects.create(user=user_with_role(role)).key}"}
    known = {"namespace": "tenant-a", "model_key": str(profile.model_key), "node": "gpu-0"}
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= set(ENDPOINTS)
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=examples,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case):
            # Random names almost never exist, so most bodies would stop at "unknown namespace";
            # pointing them at real ones lets the rest of the generated body reach the database.
            if isinstance(case.body, dict) and isinstance(case.body.get("namespace"), str):
                case.body.update(known)
            response = case.call(headers=headers)
            case.validate_response(response, checks=[not_a_server_error])
            client_errors_name_the_problem(None, response, case)

        fuzz()
