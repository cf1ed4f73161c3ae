"""Fleet installs as one namespace, ``fleet.*``, beside a user's own code.

The repository keeps its top-level folders (``producers/``, ``consumers/``, ...) and ``pyproject.toml`` maps them to
``fleet.producers``, ``fleet.consumers``, ...: every package folder must be listed there, nothing may import the
bare names (a user's own ``schemas`` package would shadow ours), and the built wheel, installed into a fresh
virtual environment, serves a user project that has packages named ``schemas``, ``dags`` and ``producers`` of its
own.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPONENTS = ("schemas", "producers", "consumers", "dispatcher", "autoscaler", "dags")
SOURCE_FOLDERS = ("fleet", *COMPONENTS, "tests", "benchmarks", "scripts")


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def package_folders() -> dict[str, Path]:
    """Every folder holding an ``__init__.py`` under the product's folders, by its ``fleet.*`` name."""
    found: dict[str, Path] = {}
    for top in ("fleet", *COMPONENTS):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            if rel.parts and rel.parts[0] in COMPONENTS and top == "fleet":
                continue  # fleet/<component> is the link to ../<component>, listed under its own name
            parts = () if str(rel) == "." else rel.parts
            name = ".".join(["fleet", *parts] if top == "fleet" else ["fleet", top, *parts])
            found[name] = init.parent
    return found


def test_every_package_folder_is_installed_under_its_fleet_name() -> None:
    setuptools = pyproject()["tool"]["setuptools"]
    assert sorted(setuptools["packages"]) == sorted(package_folders())
    assert setuptools["package-dir"] == {"fleet": "fleet", **{f"fleet.{c}": c for c in COMPONENTS}}
    for component in COMPONENTS:  # a checkout, mypy and every tool see the installed tree
        link = ROOT / "fleet" / component
        assert link.is_symlink() and link.resolve() == (ROOT / component).resolve(), link


def bare_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in COMPONENTS]
    return found


def test_nothing_imports_a_component_by_its_bare_name() -> None:
    files = [
        path
        for folder in SOURCE_FOLDERS
        for path in (ROOT / folder).rglob("*.py")
        if path.relative_to(ROOT).parts[:2] not in {("fleet", c) for c in COMPONENTS}  # the links: seen once
    ]
    problems = [problem for path in files for problem in bare_imports(path)]
    assert problems == [], "import these as fleet.<component>:\n" + "\n".join(problems)


USER_PROJECT = {
    "schemas/__init__.py": "WHO = 'the user project'\n",
    "dags/__init__.py": "WHO = 'the user project'\n",
    "producers/__init__.py": "WHO = 'the user project'\n",
    "mypackage/__init__.py": "",
    "mypackage/models.py": """
        from pydantic import BaseModel

        from fleet import ModelHandler, ModelSpec
        from schemas import WHO


        class Text(BaseModel):
            text: str


        class Length(ModelHandler[Text, dict]):
            spec = ModelSpec(name="length", input_model=Text, output_model=dict)

            def load(self) -> None:
                self.owner = WHO

            def predict(self, inputs: list[Text]) -> list[dict]:
                return [{"length": len(i.text), "owner": self.owner} for i in inputs]
    """,
    "main.py": """
        import dags
        import producers
        import schemas

        import fleet
        from fleet import FleetClient, FleetSyncClient
        from fleet.producers.sdk import FleetClient as Same
        from mypackage.models import Length, Text

        assert FleetClient is Same and FleetSyncClient.__module__ == "fleet.producers.sdk_sync"
        assert schemas.WHO == dags.WHO == producers.WHO == "the user project"
        handler = Length()
        handler.load()
        print(handler.predict([Text(text="four")]), fleet.__file__)
    """,
}


@pytest.mark.slow
def test_the_wheel_serves_a_user_project_with_packages_named_like_fleets(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    uv = Path(sys.executable).parent / "uv"
    subprocess.run([str(uv), "build", "--wheel", "--quiet", "--out-dir", str(dist), str(ROOT)], check=True, timeout=300)
    (wheel,) = dist.glob("fleet_inference-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # the wheel alone goes into the fresh environment; its dependencies are the test environment's (a .pth behind
    # the fresh site-packages, so the wheel's own files are found first)
    site = Path(
        subprocess.check_output([str(python), "-c", "import site; print(site.getsitepackages()[0])"], text=True).strip()
    )
    ours = [p for p in sys.path if p.endswith("site-packages")]
    subprocess.run(
        [str(uv), "pip", "install", "--quiet", "--no-deps", "--python", str(python), str(wheel)],
        check=True,
        timeout=300,
    )
    (site / "zz_test_dependencies.pth").write_text("\n".join(ours) + "\n")
    project = tmp_path / "project"
    for name, text in USER_PROJECT.items():
        path = project / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run([str(python), "main.py"], cwd=project, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    output, fleet_file = result.stdout.strip().rsplit(" ", 1)
    assert output == "[{'length': 4, 'owner': 'the user project'}]"
    assert Path(fleet_file).is_relative_to(site), "the installed wheel, not the checkout, served the import"
    installed = {p.name for p in (site / "fleet").iterdir()}
    assert set(COMPONENTS) <= installed and not any((site / c).exists() for c in COMPONENTS)
