"""Settings shared by every environment; values come from the environment in one place."""

import os
import sys

from controlplane.runtime.environment import REPO_ROOT, ConfigurationError, frontend_dirs, load_environment
from controlplane.runtime.node_addresses import allow_list_parse
from controlplane.settings import celery as celery_settings
from controlplane.settings import channels as channels_settings
from controlplane.settings import drf as drf_settings
from controlplane.settings import security as security_settings

try:
    ENV = load_environment()
    _SECURITY = security_settings.settings(os.environ)
except ConfigurationError as exc:
    # One line naming the variable, then stop: a half-configured control plane is worse than none.
    raise SystemExit(f"strata: {exc}") from None

BASE_DIR = REPO_ROOT
VAR_DIR = ENV.var_dir
TEMPLATES_DIR, FRONTEND_STATIC_DIR, UPLOT_DIR = frontend_dirs()

SECRET_KEY = os.environ.get("STRATA_SECRET_KEY", "")
DEBUG = False
ALLOWED_HOSTS = [h for h in os.environ.get("STRATA_ALLOWED_HOSTS", "127.0.0.1,localhost").split(",") if h]
CSRF_TRUSTED_ORIGINS = [o for o in os.environ.get("STRATA_CSRF_TRUSTED_ORIGINS", "").split(",") if o]

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "django_celery_beat",
    "controlplane.accounts",
    "controlplane.directory",
    "controlplane.policies",
    "controlplane.movements",
    "controlplane.telemetry",
    "controlplane.dashboard",
    "worker",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "controlplane.middleware.ContentSecurityPolicyMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [TEMPLATES_DIR],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]
WSGI_APPLICATION = None

DATABASES = {"default": ENV.database.django()}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": ENV.redis.url_for_db(ENV.redis.db + 2),
        "KEY_PREFIX": "strata",
    }
}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = VAR_DIR / "static"
STATICFILES_DIRS = [
    FRONTEND_STATIC_DIR,
    # The charting library, installed from npm with frontend/package-lock.json by `make setup`.
    ("vendor/uplot", UPLOT_DIR),
]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
}

# Seconds between node heartbeats that the control plane expects by default; a node reports its own.
STRATA_HEARTBEAT_SECONDS = float(os.environ.get("STRATA_HEARTBEAT_SECONDS", "5"))
STRATA_STALE_AFTER_MISSED = 3
# The heartbeat intervals a node may declare: a longer one would keep a dead node `up` for longer
# (3 intervals, on the database's clock). An hour is the longest: a test registers a node that
# never beats again with it.
STRATA_HEARTBEAT_MIN_SECONDS = 0.1
STRATA_HEARTBEAT_MAX_SECONDS = 3600.0
# The key the control plane reads nodes' request timelines with when a node has no credential of
# its own (`strata_node_credential` issues each credentialed node its own key instead).
STRATA_NODE_ADMIN_KEY = os.environ.get("STRATA_NODE_ADMIN_KEY", "")
# Node addresses the operator vouches for (controlplane.runtime.node_addresses): host names,
# `*.suffix` patterns, addresses and CIDR networks, comma-separated. Any other address a node
# reports must resolve to where its heartbeat came from, or be loopback for a local socket.
try:
    STRATA_NODE_ADDRESSES = allow_list_parse(os.environ.get("STRATA_NODE_ADDRESSES", ""))
except ValueError as exc:
    raise SystemExit(f"strata: {exc}") from None

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain", "stream": sys.stderr}},
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {
        "strata": {"level": os.environ.get("STRATA_LOG_LEVEL", "INFO"), "propagate": True},
        "celery": {"level": "WARNING"},
    },
}

globals().update(celery_settings.settings(ENV))
globals().update(channels_settings.settings(ENV))
globals().update(drf_settings.settings())
globals().update(_SECURITY)
