"""Test settings for node processes in the fault tests: a broker visibility timeout of a few
seconds, so a message whose worker was killed or stopped is delivered again quickly."""

import os

from controlplane.settings import test
from controlplane.settings.inherit import settings_of

globals().update(settings_of(test))

CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": int(os.environ.get("STRATA_TEST_VISIBILITY_TIMEOUT_S", "4")),
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
}
