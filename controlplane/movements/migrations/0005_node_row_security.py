"""A node's role updates only the movements its own worker executes (exec_node); the control
plane (the tables' owner) is not bound. See directory 0009 for the node roles."""

from django.db import migrations

POLICIES = """
ALTER TABLE movements_movement ENABLE ROW LEVEL SECURITY;
CREATE POLICY movement_read ON movements_movement FOR SELECT USING (true);
CREATE POLICY movement_own_update ON movements_movement FOR UPDATE
    USING (exec_node = (SELECT strata_node_name())) WITH CHECK (exec_node = (SELECT strata_node_name()));
"""

UNDO = """
DROP POLICY movement_own_update ON movements_movement;
DROP POLICY movement_read ON movements_movement;
ALTER TABLE movements_movement DISABLE ROW LEVEL SECURITY;
"""


class Migration(migrations.Migration):
    dependencies = [
        ("movements", "0004_quota_schedule"),
        ("directory", "0009_node_credentials"),
    ]

    operations = [migrations.RunSQL(POLICIES, UNDO)]
