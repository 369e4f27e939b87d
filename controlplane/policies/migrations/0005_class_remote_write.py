"""A priority class's remote write (when its blocks reach L3). Versions stored before the field
existed describe classes that behaved as its default (on-demotion); their snapshots say so."""

from django.db import migrations, models


def _versions_fill(apps, schema_editor):
    PolicyVersion = apps.get_model("policies", "PolicyVersion")
    for version in PolicyVersion.objects.all():
        classes = version.snapshot.get("classes", [])
        if all("remote_write" in c for c in classes):
            continue
        version.snapshot["classes"] = [{**c, "remote_write": c.get("remote_write", "on-demotion")} for c in classes]
        version.save(update_fields=["snapshot"])


class Migration(migrations.Migration):
    dependencies = [
        ("policies", "0004_load_following"),
    ]

    operations = [
        migrations.AddField(
            model_name="priorityclass",
            name="remote_write",
            field=models.CharField(
                choices=[
                    ("on-demotion", "On demotion (the planner moves them there)"),
                    ("write-through", "Write-through (at write-back, beside the node's copy)"),
                ],
                default="on-demotion",
                help_text="When the class's blocks reach L3: on-demotion (by the planner) or write-through "
                "(at write-back).",
                max_length=16,
            ),
        ),
        migrations.AddConstraint(
            model_name="priorityclass",
            constraint=models.CheckConstraint(
                condition=models.Q(("remote_write__in", ["on-demotion", "write-through"])),
                name="priorityclass_remote_write_known",
            ),
        ),
        migrations.RunPython(_versions_fill, migrations.RunPython.noop),
    ]
