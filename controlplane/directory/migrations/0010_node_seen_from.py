"""Where each node's heartbeat came from: `Node.seen_from`, written by the database.

A node writes its own row (migration 0009), so a value it sent would prove nothing. The trigger
below sets `seen_from` to `inet_client_addr()`, the address of the connection that wrote the row
(NULL over a unix socket), whenever a heartbeat lands (a new row, or `heartbeats`, `address` or
`engine_address` changing), and keeps the old value on every other update (the control plane
marking a node stale), whatever the statement tried to write. The control plane checks a node's
reported address against it before sending the node anything (controlplane.runtime.node_addresses)."""

from django.db import migrations, models

TRIGGER = """
CREATE FUNCTION strata_node_seen_from() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.seen_from := inet_client_addr();
    ELSIF NEW.heartbeats IS DISTINCT FROM OLD.heartbeats
        OR NEW.address IS DISTINCT FROM OLD.address
        OR NEW.engine_address IS DISTINCT FROM OLD.engine_address THEN
        NEW.seen_from := inet_client_addr();
    ELSE
        NEW.seen_from := OLD.seen_from;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER node_seen_from BEFORE INSERT OR UPDATE ON directory_node
    FOR EACH ROW EXECUTE FUNCTION strata_node_seen_from();
"""

UNDO = """
DROP TRIGGER node_seen_from ON directory_node;
DROP FUNCTION strata_node_seen_from();
"""


class Migration(migrations.Migration):
    dependencies = [
        ("directory", "0009_node_credentials"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="seen_from",
            field=models.GenericIPAddressField(
                blank=True,
                editable=False,
                help_text="Where the last heartbeat came from, as the database saw the connection (empty: a local "
                "socket). Set by a trigger (migration 0010), never by the node.",
                null=True,
            ),
        ),
        migrations.RunSQL(TRIGGER, UNDO),
    ]
