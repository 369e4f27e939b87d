"""Namespace quotas (bytes per namespace per tier), part of the versioned policy state: every stored
version gains an empty quota list, which is what the policies had before quotas existed."""

from django.db import migrations, models


def versions_with_quotas(apps, schema_editor):
    for version in apps.get_model("policies", "PolicyVersion").objects.all():
        if "quotas" not in version.snapshot:
            version.snapshot["quotas"] = []
            version.save(update_fields=["snapshot"])


def versions_without_quotas(apps, schema_editor):
    for version in apps.get_model("policies", "PolicyVersion").objects.all():
        if version.snapshot.pop("quotas", None) is not None:
            version.save(update_fields=["snapshot"])


class Migration(migrations.Migration):
    dependencies = [
        ("policies", "0002_builtin_policies"),
    ]

    operations = [
        migrations.CreateModel(
            name="NamespaceQuota",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("namespace", models.SlugField(help_text="Name of the namespace the quota caps.", max_length=63)),
                (
                    "tier",
                    models.CharField(
                        choices=[
                            ("host", "L2 host (per node)"),
                            ("disk", "L2 disk (per node)"),
                            ("remote", "L3 remote (the fleet)"),
                        ],
                        max_length=8,
                    ),
                ),
                (
                    "bytes",
                    models.PositiveBigIntegerField(
                        help_text="Bytes the namespace may hold (per node for host and disk)."
                    ),
                ),
                ("updated_at", models.DateTimeField(auto_now=True)),
            ],
            options={
                "ordering": ["namespace", "tier"],
                "constraints": [
                    models.UniqueConstraint(fields=("namespace", "tier"), name="namespacequota_namespace_tier_uniq"),
                    models.CheckConstraint(condition=models.Q(("bytes__gt", 0)), name="namespacequota_bytes_positive"),
                    models.CheckConstraint(
                        condition=models.Q(("tier__in", ["host", "disk", "remote"])), name="namespacequota_tier_known"
                    ),
                ],
            },
        ),
        migrations.RunPython(versions_with_quotas, versions_without_quotas),
    ]
