"""App config of the directory."""

from django.apps import AppConfig


class DirectoryConfig(AppConfig):
    name = "controlplane.directory"
    label = "directory"
    verbose_name = "Block directory"
