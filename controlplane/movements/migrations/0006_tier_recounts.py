"""The reconcile job's recounts of tier usage counters, one row per (node, tier); blank node for
the shared remote tier. A node's role writes its own rows and the shared tier's (row-level
security, as for placements; directory 0009 has the node roles)."""

from django.db import migrations, models

POLICIES = """
ALTER TABLE movements_tierrecount ENABLE ROW LEVEL SECURITY;
CREATE POLICY tierrecount_read ON movements_tierrecount FOR SELECT USING (true);
CREATE POLICY tierrecount_own ON movements_tierrecount FOR ALL
    USING (node = '' OR node = (SELECT strata_node_name()))
    WITH CHECK (node = '' OR node = (SELECT strata_node_name()));
"""

UNDO = """
DROP POLICY tierrecount_own ON movements_tierrecount;
DROP POLICY tierrecount_read ON movements_tierrecount;
ALTER TABLE movements_tierrecount DISABLE ROW LEVEL SECURITY;
"""


class Migration(migrations.Migration):
    dependencies = [
        ("movements", "0005_node_row_security"),
    ]

    operations = [
        migrations.CreateModel(
            name="TierRecount",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("node", models.CharField(blank=True, max_length=63)),
                ("tier", models.CharField(max_length=8)),
                (
                    "drift_bytes",
                    models.BigIntegerField(
                        help_text="Counted minus held at the last recount (positive: bytes counted that were not there)."
                    ),
                ),
                ("drift_blocks", models.BigIntegerField(help_text="Counted minus held blocks at the last recount.")),
                (
                    "corrections",
                    models.PositiveBigIntegerField(
                        default=0, help_text="Recounts that found a drift and corrected it."
                    ),
                ),
                (
                    "corrected_bytes",
                    models.PositiveBigIntegerField(default=0, help_text="Sum of the drifts corrected, in bytes."),
                ),
                ("recounted_at", models.DateTimeField()),
            ],
            options={
                "ordering": ["tier", "node"],
                "constraints": [models.UniqueConstraint(fields=("node", "tier"), name="tierrecount_node_tier_uniq")],
            },
        ),
        migrations.RunSQL(POLICIES, UNDO),
    ]
