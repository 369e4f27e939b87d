"""The engines' REST endpoints at their request rates: the per-user throttle costs one counter per
window whatever the rate, and a lookup's keys are parsed in one pass with the same answers."""

from __future__ import annotations

import uuid

import pytest

from controlplane.directory.api.serializers import LookupInputSerializer
from controlplane.directory.api.views import WindowRateThrottle
from tests.directory.conftest import user_with_role

pytestmark = pytest.mark.django_db


class _Request:
    def __init__(self, user: object) -> None:
        self.user = user
        self.META = {"REMOTE_ADDR": "127.0.0.1"}


@pytest.fixture
def clock(monkeypatch):  # type: ignore[no-untyped-def]
    """The throttles' time, set by the test."""
    now = [6000.0]
    monkeypatch.setattr(WindowRateThrottle, "timer", staticmethod(lambda: now[0]))
    return now


@pytest.fixture
def three_a_minute(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(WindowRateThrottle, "THROTTLE_RATES", {**WindowRateThrottle.THROTTLE_RATES, "user": "3/min"})


def test_the_window_throttle_counts_one_integer_per_window(clock, three_a_minute, throttle_cache):
    user = user_with_role("viewer")
    request = _Request(user)
    assert [WindowRateThrottle().allow_request(request, None) for _ in range(4)] == [True, True, True, False]
    throttle = WindowRateThrottle()
    clock[0] += 45
    assert not throttle.allow_request(request, None)
    assert throttle.wait() == pytest.approx(15)
    clock[0] += 15  # the next window
    assert WindowRateThrottle().allow_request(request, None)
    # One integer per window (minutes 100 and 101), not a list of request times.
    assert [throttle_cache.get(f"throttle_user_{user.pk}:{window}") for window in (100, 101)] == [5, 1]


def test_lookups_past_the_user_rate_are_refused_with_retry_after(clock, three_a_minute, api_as, registration, profile):
    client = api_as("viewer")
    body = {"namespace": "tenant-a", "model_key": str(profile.model_key), "prefix_keys": [str(uuid.uuid4())]}
    codes = [client.post("/api/v1/blocks/lookup/", body, format="json") for _ in range(4)]
    assert [c.status_code for c in codes] == [200, 200, 200, 429]
    assert codes[-1]["Retry-After"] == "60"


@pytest.mark.parametrize(
    "keys, error_at",
    [
        ([str(uuid.uuid4()), "not-a-uuid"], 1),
        (["{12345678-1234-5678-1234-567812345678}", 7, None], 2),
    ],
)
def test_key_lists_parse_as_drf_does(keys, error_at):
    data = LookupInputSerializer(data={"namespace": "a", "model_key": str(uuid.uuid4()), "prefix_keys": keys})
    assert not data.is_valid()
    assert list(data.errors["prefix_keys"]) == [error_at]


def test_key_lists_accept_every_uuid_spelling_drf_accepts():
    key = uuid.uuid4()
    spellings = [str(key), str(key).upper(), key.hex, "{" + str(key) + "}", f"urn:uuid:{key}", key.int]
    data = LookupInputSerializer(data={"namespace": "a", "model_key": str(uuid.uuid4()), "prefix_keys": spellings})
    assert data.is_valid(), data.errors
    assert data.validated_data["prefix_keys"] == [key] * len(spellings)
