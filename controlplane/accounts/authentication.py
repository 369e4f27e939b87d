"""Token authentication that reads the user's role with the token: one query per API request."""

from typing import Any

from django.contrib.postgres.aggregates import ArrayAgg
from django.utils.translation import gettext_lazy as _
from rest_framework import authentication, exceptions


class TokenAuthentication(authentication.TokenAuthentication):
    """DRF's `Authorization: Token <key>`, with the user's group names fetched in the same query as
    the token and the user (an aggregate over the user's groups), so the role check that follows
    (`role_of`) asks the database nothing more. Engines call the lookup endpoint for every prompt:
    each round trip saved is on their time to first token. Nothing is kept between requests: a
    changed group or a deleted token counts from the next request."""

    def authenticate_credentials(self, key: str) -> tuple[Any, Any]:
        model = self.get_model()
        try:
            token = (
                model.objects.select_related("user")
                .annotate(strata_group_names=ArrayAgg("user__groups__name"))
                .get(key=key)
            )
        except model.DoesNotExist:
            raise exceptions.AuthenticationFailed(_("Invalid token.")) from None
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed(_("User inactive or deleted."))
        # A user in no group comes back as [None] (the join found no row).
        token.user.strata_group_names = frozenset(name for name in token.strata_group_names if name)
        return token.user, token
