"""Schedule the beat job that marks nodes stale after 3 missed heartbeats (every 5 seconds)."""

from django.db import migrations

TASK_NAME = "directory: mark stale nodes"


def schedule(apps, schema_editor):
    interval = apps.get_model("django_celery_beat", "IntervalSchedule")
    periodic = apps.get_model("django_celery_beat", "PeriodicTask")
    every, _ = interval.objects.get_or_create(every=5, period="seconds")
    periodic.objects.update_or_create(
        name=TASK_NAME,
        defaults={
            "task": "directory.nodes_mark_stale",
            "interval": every,
            "queue": "control",
            "enabled": True,
            "description": "Mark nodes stale after 3 missed heartbeats.",
        },
    )


def unschedule(apps, schema_editor):
    apps.get_model("django_celery_beat", "PeriodicTask").objects.filter(name=TASK_NAME).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("directory", "0001_initial"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]
    operations = [migrations.RunPython(schedule, unschedule)]
