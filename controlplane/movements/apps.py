from django.apps import AppConfig


class MovementsConfig(AppConfig):
    name = "controlplane.movements"
    label = "movements"
    verbose_name = "Movements"
    default_auto_field = "django.db.models.BigAutoField"
