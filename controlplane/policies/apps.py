from django.apps import AppConfig


class PoliciesConfig(AppConfig):
    name = "controlplane.policies"
    label = "policies"
    verbose_name = "Policies"
    default_auto_field = "django.db.models.BigAutoField"
