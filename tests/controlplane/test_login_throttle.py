"""Failed logins are throttled on the dashboard's and the admin's login forms, in the real (Redis)
cache: past the limit an address gets 429 until the window ends, the right password included;
other addresses keep logging in; many addresses together lock the user name they guess."""

import time
import uuid

import pytest
from django.contrib.auth.models import User
from django.test import Client

LOGINS = ["/accounts/login/", "/admin/login/"]
PASSWORD = "right-horse-battery-staple"


@pytest.fixture
def limits(settings):
    settings.STRATA_LOGIN_FAILURES = 3
    settings.STRATA_LOGIN_USER_FAILURES = 5
    settings.STRATA_LOGIN_WINDOW_SECONDS = 2
    return settings


@pytest.fixture
def user(db):
    # Unique per test: the cache (and so the counts) outlives the test database.
    return User.objects.create_user(
        username=f"ops-{uuid.uuid4().hex[:8]}", password=PASSWORD, is_staff=True, is_superuser=True
    )


def address() -> str:
    """An address no other test (or earlier run) has used."""
    b = uuid.uuid4().bytes
    return f"10.{b[0]}.{b[1]}.{b[2] or 1}"


def login(url, username, password, ip):
    return Client().post(url, {"username": username, "password": password}, REMOTE_ADDR=ip)


@pytest.mark.django_db
@pytest.mark.parametrize("url", LOGINS)
def test_an_address_past_the_limit_is_refused_until_the_window_ends(limits, user, url):
    ip = address()
    for _ in range(3):
        assert login(url, user.username, "wrong", ip).status_code == 200  # the form again
    refused = login(url, user.username, "wrong", ip)
    assert refused.status_code == 429
    assert "Too many failed logins from your address" in refused.content.decode()
    assert 1 <= int(refused["Retry-After"]) <= 2
    # The right password meanwhile: refused too, or the answer would tell a guesser it was right.
    assert login(url, user.username, PASSWORD, ip).status_code == 429
    # Another address, the same user name: unaffected (3 failures are below the name's limit of 5).
    assert login(url, user.username, PASSWORD, address()).status_code == 302
    time.sleep(2.1)
    assert login(url, user.username, PASSWORD, ip).status_code == 302


@pytest.mark.django_db
def test_failures_on_either_form_count_together_and_plain_visits_are_not_throttled(limits, user):
    ip = address()
    for url in ("/accounts/login/", "/admin/login/", "/accounts/login/"):
        assert login(url, user.username, "wrong", ip).status_code == 200
    assert login("/admin/login/", user.username, PASSWORD, ip).status_code == 429
    assert Client().get("/accounts/login/", REMOTE_ADDR=ip).status_code == 200


@pytest.mark.django_db
def test_many_addresses_guessing_one_name_lock_that_name(limits, user):
    for _ in range(5):
        assert login("/accounts/login/", user.username, "wrong", address()).status_code == 200
    refused = login("/accounts/login/", user.username.upper(), PASSWORD, address())
    assert refused.status_code == 429
    assert "Too many failed logins for this user name" in refused.content.decode()
    other = User.objects.create_user(username=f"viewer-{uuid.uuid4().hex[:8]}", password=PASSWORD)
    assert login("/accounts/login/", other.username, PASSWORD, address()).status_code == 302


@pytest.mark.django_db
def test_ipv6_clients_are_counted_per_64(limits, user):
    net = uuid.uuid4().hex[:4]
    for host in ("1", "2", "3"):
        assert login("/accounts/login/", user.username, "wrong", f"2001:db8:{net}::{host}").status_code == 200
    assert login("/accounts/login/", user.username, PASSWORD, f"2001:db8:{net}::99").status_code == 429


@pytest.mark.django_db
def test_no_limit_with_zero(settings, user):
    settings.STRATA_LOGIN_FAILURES = 0
    settings.STRATA_LOGIN_USER_FAILURES = 0
    ip = address()
    for _ in range(12):
        assert login("/accounts/login/", user.username, "wrong", ip).status_code == 200
    assert login("/accounts/login/", user.username, PASSWORD, ip).status_code == 302


@pytest.mark.django_db
def test_an_unreachable_cache_leaves_logins_unthrottled(limits, user, monkeypatch, caplog):
    from controlplane.accounts import throttle

    class Down:
        def __getattr__(self, name):
            raise ConnectionError("redis down")

    monkeypatch.setattr(throttle, "caches", {"default": Down()})
    assert login("/accounts/login/", user.username, "wrong", address()).status_code == 200
    assert login("/accounts/login/", user.username, PASSWORD, address()).status_code == 302
    assert "the cache cannot be read" in caplog.text


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"STRATA_LOGIN_FAILURES": "lots"}, "STRATA_LOGIN_FAILURES: expected a whole number of failed logins"),
        ({"STRATA_LOGIN_USER_FAILURES": "-1"}, "STRATA_LOGIN_USER_FAILURES: expected a whole number of failed"),
        ({"STRATA_LOGIN_WINDOW_SECONDS": "15m"}, "STRATA_LOGIN_WINDOW_SECONDS: expected a whole number of seconds"),
        ({"STRATA_LOGIN_WINDOW_SECONDS": "0"}, "STRATA_LOGIN_WINDOW_SECONDS: must be at least 1 second"),
    ],
)
def test_bad_limits_are_refused_naming_the_variable(env, message):
    from controlplane.runtime.environment import ConfigurationError
    from controlplane.settings import security

    with pytest.raises(ConfigurationError, match=message):
        security.settings(env)


def test_the_defaults():
    from controlplane.settings import security

    got = security.settings({})
    assert (got["STRATA_LOGIN_FAILURES"], got["STRATA_LOGIN_USER_FAILURES"], got["STRATA_LOGIN_WINDOW_SECONDS"]) == (
        10,
        50,
        900,
    )
