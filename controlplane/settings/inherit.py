"""Copy the UPPERCASE settings of one module into another (explicit, instead of a star import)."""

from types import ModuleType
from typing import Any


def settings_of(module: ModuleType) -> dict[str, Any]:
    return {name: value for name, value in vars(module).items() if name.isupper()}
