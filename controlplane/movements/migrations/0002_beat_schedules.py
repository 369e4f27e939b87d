"""Schedule the movements beat jobs: the watermark planner, the redispatch sweep, scrubs and reconciles."""

from django.db import migrations

JOBS = [
    # (name, task, every seconds, description)
    (
        "movements: plan over watermark",
        "movements.plan_watermarks",
        10,
        "Plan movements for nodes whose reported tier use is over the high watermark.",
    ),
    (
        "movements: redispatch stuck",
        "movements.redispatch",
        60,
        "Queue again movements that stopped moving; cancel those whose node is gone.",
    ),
    (
        "movements: reconcile nodes",
        "movements.reconcile_nodes",
        600,
        "Delete bytes no placement names; mark copies whose bytes vanished.",
    ),
    (
        "movements: scrub nodes",
        "movements.scrub_nodes",
        3600,
        "Verify every READY copy's checksum on every node; quarantine corrupt ones.",
    ),
]


def schedule(apps, schema_editor):
    interval = apps.get_model("django_celery_beat", "IntervalSchedule")
    periodic = apps.get_model("django_celery_beat", "PeriodicTask")
    for name, task, seconds, description in JOBS:
        every, _ = interval.objects.get_or_create(every=seconds, period="seconds")
        periodic.objects.update_or_create(
            name=name,
            defaults={"task": task, "interval": every, "queue": "control", "enabled": True, "description": description},
        )


def unschedule(apps, schema_editor):
    apps.get_model("django_celery_beat", "PeriodicTask").objects.filter(name__in=[j[0] for j in JOBS]).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("movements", "0001_initial"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]
    operations = [migrations.RunPython(schedule, unschedule)]
