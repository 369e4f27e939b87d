"""Create namespaces (tenants) that do not exist yet: `manage.py strata_namespace acme globex`."""

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from controlplane.directory.errors import DirectoryError
from controlplane.directory.services import namespace_ensure


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("names", nargs="+", help="namespace names")

    def handle(self, *args: Any, names: list[str], **options: Any) -> None:
        for name in names:
            try:
                namespace = namespace_ensure(name=name)
            except (DirectoryError, ValueError) as exc:
                raise CommandError(f"namespace {name!r}: {exc}") from exc
            self.stdout.write(f"namespace {namespace.name}: ready")
