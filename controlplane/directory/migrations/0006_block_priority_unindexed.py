"""Drop the two indexes of Block.priority (a slug field's default): no query filters on it, and every
registered block paid two index writes for them."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("directory", "0005_node_group"),
    ]

    operations = [
        migrations.AlterField(
            model_name="block",
            name="priority",
            field=models.SlugField(
                db_index=False,
                default="default",
                help_text="Priority class (the policies app defines them).",
                max_length=63,
            ),
        ),
    ]
