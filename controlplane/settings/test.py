"""Test settings: the real PostgreSQL and Redis, fast password hashing."""

from controlplane.settings import base
from controlplane.settings.inherit import settings_of

globals().update(settings_of(base))

DEBUG = False
SECRET_KEY = base.SECRET_KEY or "strata-test-key-not-for-production-" + "x" * 30
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
ALLOWED_HOSTS = ["testserver", "127.0.0.1", "localhost"]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}
# Every test run gets its own throttling/cache namespace.
CACHES = {
    "default": {**base.CACHES["default"], "KEY_PREFIX": "strata-test"},
}
