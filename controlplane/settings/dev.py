"""Development and demo settings: DEBUG on, a generated secret key kept under var/."""

import secrets

from controlplane.settings import base
from controlplane.settings.inherit import settings_of

globals().update(settings_of(base))

DEBUG = True


def _dev_secret_key() -> str:
    path = base.VAR_DIR / "secret-key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


SECRET_KEY = base.SECRET_KEY or _dev_secret_key()
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}
