"""Django REST framework and the OpenAPI schema."""

from typing import Any

from controlplane import __version__


def settings() -> dict[str, Any]:
    return {
        "REST_FRAMEWORK": {
            "DEFAULT_AUTHENTICATION_CLASSES": [
                # Token first: its WWW-Authenticate header makes "not logged in" a 401, not a 403.
                "controlplane.accounts.authentication.TokenAuthentication",
                "rest_framework.authentication.SessionAuthentication",
            ],
            # DRF's own three, JSON with a bound on nesting (a 400 where DRF's gives a 500).
            "DEFAULT_PARSER_CLASSES": [
                "controlplane.parsers.JSONParser",
                "rest_framework.parsers.FormParser",
                "rest_framework.parsers.MultiPartParser",
            ],
            "DEFAULT_PERMISSION_CLASSES": ["controlplane.accounts.permissions.RolePermission"],
            "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
            "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.CursorPagination",
            "PAGE_SIZE": 100,
            "DEFAULT_THROTTLE_CLASSES": [
                "rest_framework.throttling.UserRateThrottle",
                "rest_framework.throttling.AnonRateThrottle",
            ],
            "DEFAULT_THROTTLE_RATES": {"user": "100000/min", "anon": "60/min"},
            "DEFAULT_RENDERER_CLASSES": [
                "rest_framework.renderers.JSONRenderer",
                "rest_framework.renderers.BrowsableAPIRenderer",
            ],
        },
        "SPECTACULAR_SETTINGS": {
            "TITLE": "Strata control plane API",
            "DESCRIPTION": "Tiered KV-cache block directory, nodes, policies and movements.",
            "VERSION": __version__,
            "SERVE_INCLUDE_SCHEMA": False,
            "SCHEMA_PATH_PREFIX": r"/api/v1",
            "COMPONENT_SPLIT_REQUEST": True,
            # Swagger UI and ReDoc from the installed package, served as our static files: the
            # docs load with no other host reachable, and run only code pinned in pyproject.toml.
            "SWAGGER_UI_DIST": "SIDECAR",
            "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
            "REDOC_DIST": "SIDECAR",
            # Two apps have a `kind` field: name their enums apart in the schema.
            "ENUM_NAME_OVERRIDES": {
                "ModeKindEnum": "controlplane.policies.choices.ModeKind",
                "MovementKindEnum": "controlplane.movements.choices.MovementKind",
            },
        },
    }
