"""The wheel's one build step beyond pyproject.toml: the dashboard's templates, static files and
charting library (frontend/, the library from npm) are copied into the `controlplane.dashboard`
package as `frontend/`, where the settings find them when Strata runs from an installed wheel
rather than a checkout (controlplane.runtime.environment.frontend_dirs)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
DASHBOARD_ASSETS = {
    "templates": ROOT / "frontend" / "templates",
    "static": ROOT / "frontend" / "static",
    "vendor/uplot": ROOT / "frontend" / "node_modules" / "uplot" / "dist",
}


class BuildWithDashboard(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install serves the checkout's frontend/ itself
        target = Path(self.build_lib) / "controlplane" / "dashboard" / "frontend"
        for name, source in DASHBOARD_ASSETS.items():
            if not source.is_dir():
                raise SystemExit(
                    f"the wheel carries the dashboard, and {source} is missing: "
                    "run `npm ci --prefix frontend` (make setup does) and build again"
                )
            shutil.copytree(source, target / name, dirs_exist_ok=True)


# The native routines (pyproject's ext-modules) are plain C loaded with ctypes: one wheel for every
# Python from 3.11 on.
setup(cmdclass={"build_py": BuildWithDashboard}, options={"bdist_wheel": {"py_limited_api": "cp311"}})
