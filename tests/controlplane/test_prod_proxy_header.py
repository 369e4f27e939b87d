"""Production settings: the proxy's TLS header is trusted only when STRATA_PROXY_SSL_HEADER names it.
Trusted unasked, a client that reaches daphne directly (docker-compose publishes its port) could
send `X-Forwarded-Proto: https` and pass for HTTPS."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.controlplane.test_prod_settings import prod_probe

# What a request carrying the header looks like to Django under these settings.
PROBE = (
    "from django.conf import settings; from django.test import RequestFactory; import json; "
    "r = RequestFactory().get('/', HTTP_X_FORWARDED_PROTO='https', HTTP_X_SCHEME='https'); "
    "print(json.dumps({'header': settings.SECURE_PROXY_SSL_HEADER, 'secure': r.is_secure()}))"
)


def _prod(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return prod_probe(tmp_path, PROBE, **env)


def test_by_default_no_client_header_makes_a_request_secure(tmp_path):
    result = _prod(tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"header": None, "secure": False}


@pytest.mark.parametrize(
    ("value", "meta"), [("X-Forwarded-Proto", "HTTP_X_FORWARDED_PROTO"), ("x-scheme", "HTTP_X_SCHEME")]
)
def test_the_header_the_operator_names_is_trusted(tmp_path, value, meta):
    result = _prod(tmp_path, STRATA_PROXY_SSL_HEADER=value)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"header": [meta, "https"], "secure": True}


def test_an_empty_value_trusts_none(tmp_path):
    result = _prod(tmp_path, STRATA_PROXY_SSL_HEADER="  ")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["secure"] is False


@pytest.mark.parametrize("value", ["true", "1", "X-Forwarded-Proto: https", "X_Forwarded_Proto", "-x"])
def test_a_bad_value_stops_start_up_naming_the_variable(tmp_path, value):
    result = _prod(tmp_path, STRATA_PROXY_SSL_HEADER=value)
    assert result.returncode != 0
    assert result.stderr.strip() == (
        "strata: STRATA_PROXY_SSL_HEADER: expected the name of the header the TLS-terminating proxy sets, "
        f"such as X-Forwarded-Proto (unset: trust none), got {value!r}"
    )


def test_a_bad_login_limit_stops_start_up_too(tmp_path):
    result = _prod(tmp_path, STRATA_LOGIN_FAILURES="ten")
    assert result.returncode != 0
    assert result.stderr.strip() == (
        "strata: STRATA_LOGIN_FAILURES: expected a whole number of failed logins (0 = no limit), got 'ten'"
    )
