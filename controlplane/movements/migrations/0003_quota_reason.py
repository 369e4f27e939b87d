"""Movements gain the reason `quota`: a namespace went over its quota in the tier."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("movements", "0002_beat_schedules"),
    ]

    operations = [
        migrations.AlterField(
            model_name="movement",
            name="reason",
            field=models.CharField(
                choices=[
                    ("watermark", "A tier went over its high watermark"),
                    ("mode-switch", "A load mode was switched"),
                    ("schedule", "A scheduled migration"),
                    ("policy-change", "A policy was edited"),
                    ("manual", "An operator asked"),
                    ("ttl", "The copy outlived its tier's TTL"),
                    ("quota", "Its namespace went over its quota in the tier"),
                ],
                max_length=16,
            ),
        ),
    ]
