"""Every package of the source tree is installed: pyproject.toml lists packages by hand, and a new one
left off the list imports from a checkout's editable install but not from a wheel."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_directory_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    renamed = {folder: name for name, folder in config.get("package-dir", {}).items()}
    found = set()
    for init in ROOT.glob("autopar/**/__init__.py"):
        found.add(".".join(init.parent.relative_to(ROOT).parts))
    for folder, name in renamed.items():
        assert (ROOT / folder / "__init__.py").is_file(), f"package-dir names {folder}, which is no package"
        found.add(name)
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert listed - found == set(), f"pyproject.toml lists packages that do not exist: {sorted(listed - found)}"
