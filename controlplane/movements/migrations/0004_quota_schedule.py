"""Schedule the quota pass: every minute, namespaces over their quota give up their coldest copies."""

from django.db import migrations

NAME = "movements: plan over quota"


def schedule(apps, schema_editor):
    interval = apps.get_model("django_celery_beat", "IntervalSchedule")
    periodic = apps.get_model("django_celery_beat", "PeriodicTask")
    every, _ = interval.objects.get_or_create(every=60, period="seconds")
    periodic.objects.update_or_create(
        name=NAME,
        defaults={
            "task": "movements.plan_quotas",
            "interval": every,
            "queue": "control",
            "enabled": True,
            "description": "Move the coldest copies of namespaces over their quota out of the tiers they are over.",
        },
    )


def unschedule(apps, schema_editor):
    apps.get_model("django_celery_beat", "PeriodicTask").objects.filter(name=NAME).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("movements", "0003_quota_reason"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]
    operations = [migrations.RunPython(schedule, unschedule)]
