"""Test settings for the beat processes of the two-beats fault test: beat says each task it sends
(`celery.beat` at INFO), so the test can count what each beat sent."""

from controlplane.settings import test
from controlplane.settings.inherit import settings_of

globals().update(settings_of(test))

LOGGING = {**test.LOGGING, "loggers": {**test.LOGGING["loggers"], "celery.beat": {"level": "INFO", "propagate": True}}}
