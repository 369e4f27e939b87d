"""Node credentials: each node's own PostgreSQL role, and row-level security that holds a node's
writes to its own rows.

The control plane connects as the tables' owner, which row-level security does not bind (it is
enabled, not forced); a node's role is bound by these policies and by the grants
`controlplane.directory.services.credentials` gives its group. `strata_node_name()` and
`strata_node_id()` say which node the connected role acts as (NULL for any other role, and for a
revoked one); they run as their owner, so a node needs no read access to the credentials."""

from django.db import migrations, models

FUNCTIONS = """
CREATE FUNCTION strata_node_name() RETURNS text
LANGUAGE sql STABLE SECURITY DEFINER SET search_path FROM CURRENT AS $$
    SELECT node FROM directory_nodecredential WHERE role = session_user AND revoked_at IS NULL
$$;
CREATE FUNCTION strata_node_id() RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER SET search_path FROM CURRENT AS $$
    SELECT n.id FROM directory_node n JOIN directory_nodecredential c ON c.node = n.name
    WHERE c.role = session_user AND c.revoked_at IS NULL
$$;
"""

# Every role may read (the grants decide who reads at all); writes only to the connected node's
# own rows. `(SELECT strata_node_id())` is evaluated once per statement, not once per row.
POLICIES = """
ALTER TABLE directory_node ENABLE ROW LEVEL SECURITY;
CREATE POLICY node_read ON directory_node FOR SELECT USING (true);
CREATE POLICY node_own_insert ON directory_node FOR INSERT WITH CHECK (name = (SELECT strata_node_name()));
CREATE POLICY node_own_update ON directory_node FOR UPDATE
    USING (name = (SELECT strata_node_name())) WITH CHECK (name = (SELECT strata_node_name()));

ALTER TABLE directory_nodetier ENABLE ROW LEVEL SECURITY;
CREATE POLICY nodetier_read ON directory_nodetier FOR SELECT USING (true);
CREATE POLICY nodetier_own ON directory_nodetier FOR ALL
    USING (node_id = (SELECT strata_node_id())) WITH CHECK (node_id = (SELECT strata_node_id()));

ALTER TABLE directory_nodetraffic ENABLE ROW LEVEL SECURITY;
CREATE POLICY nodetraffic_read ON directory_nodetraffic FOR SELECT USING (true);
CREATE POLICY nodetraffic_own ON directory_nodetraffic FOR ALL
    USING (node_id = (SELECT strata_node_id())) WITH CHECK (node_id = (SELECT strata_node_id()));

-- Copies in the node's own tiers, and in the shared remote tier (node_id NULL), which every node
-- writes through to and moves blocks into.
ALTER TABLE directory_placement ENABLE ROW LEVEL SECURITY;
CREATE POLICY placement_read ON directory_placement FOR SELECT USING (true);
CREATE POLICY placement_own ON directory_placement FOR ALL
    USING (node_id IS NULL OR node_id = (SELECT strata_node_id()))
    WITH CHECK (node_id IS NULL OR node_id = (SELECT strata_node_id()));
"""

UNDO = """
DROP POLICY placement_own ON directory_placement;
DROP POLICY placement_read ON directory_placement;
ALTER TABLE directory_placement DISABLE ROW LEVEL SECURITY;
DROP POLICY nodetraffic_own ON directory_nodetraffic;
DROP POLICY nodetraffic_read ON directory_nodetraffic;
ALTER TABLE directory_nodetraffic DISABLE ROW LEVEL SECURITY;
DROP POLICY nodetier_own ON directory_nodetier;
DROP POLICY nodetier_read ON directory_nodetier;
ALTER TABLE directory_nodetier DISABLE ROW LEVEL SECURITY;
DROP POLICY node_own_update ON directory_node;
DROP POLICY node_own_insert ON directory_node;
DROP POLICY node_read ON directory_node;
ALTER TABLE directory_node DISABLE ROW LEVEL SECURITY;
DROP FUNCTION strata_node_id();
DROP FUNCTION strata_node_name();
"""


class Migration(migrations.Migration):
    dependencies = [
        ("directory", "0008_node_traffic"),
    ]

    operations = [
        migrations.CreateModel(
            name="NodeCredential",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("node", models.SlugField(help_text="Name of the node the role acts as.", max_length=63, unique=True)),
                (
                    "role",
                    models.CharField(help_text="The PostgreSQL role (LOGIN) of that node.", max_length=63, unique=True),
                ),
                ("created_at", models.DateTimeField()),
                (
                    "rotated_at",
                    models.DateTimeField(blank=True, help_text="When the password last changed.", null=True),
                ),
                ("revoked_at", models.DateTimeField(blank=True, help_text="When the role lost its login.", null=True)),
            ],
            options={"ordering": ["node"]},
        ),
        migrations.RunSQL(FUNCTIONS + POLICIES, UNDO),
    ]
