"""mkdocs hook: the reference pages are generated from the code at build time, so they cannot drift.

A page asks for generated content with a marker on a line of its own, which ``on_page_markdown`` replaces:

    <!-- fleet:generate settings -->     every FleetSettings field: its FLEET_ variable, type, default, description
    <!-- fleet:generate cli -->          ``fleet --help`` and the --help of every command and sub-command
    <!-- fleet:generate rest -->         every operation of the gateway's OpenAPI document
    <!-- fleet:generate schemas -->      the JSON Schemas ``fleet schemas export`` writes
    <!-- fleet:generate benchmarks -->   the benchmark result files in benchmarks/results/
    <!-- fleet:include deploy/README.md -->   a file of the repository, its first heading dropped

``on_files`` adds ``reference/openapi.json`` (the document itself) to the site. Nothing generated is written into
docs/ or committed. The functions are plain ``str``-returning functions, so tests can call them too.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the hook imports Fleet's own modules, also when mkdocs runs from elsewhere
    sys.path.insert(0, str(ROOT))
MARKER = re.compile(r"^<!-- fleet:(generate|include) ([\w./-]+) -->$", re.MULTILINE)
RESULTS_DIR = ROOT / "benchmarks" / "results"


@contextlib.contextmanager
def defaults_only() -> Iterator[None]:
    """Generated pages show Fleet's defaults, not whatever FLEET_* variables the build machine has set."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("FLEET_")}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def cell(text: object) -> str:
    """One table cell: no line breaks, no bare pipes."""
    return " ".join(str(text).split()).replace("|", "\\|")


# -- settings ---------------------------------------------------------------------------------------------------
def type_name(annotation: Any) -> str:
    """``dict[str, float]``, ``str | None``, ``'off' | 'keys' | None``: what a reader needs, without Annotated."""
    import types
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if annotation is type(None):
        return "None"
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if value is None or value == {} or value == [] or value == "":
        return "(none)"
    if isinstance(value, list | tuple):
        return "`" + ",".join(str(v) for v in value) + "`"
    if hasattr(value, "get_secret_value"):
        return "(secret)"
    return f"`{value}`"


def settings_markdown() -> str:
    from fleet.settings import FleetSettings

    prefix = FleetSettings.model_config.get("env_prefix", "FLEET_")
    rows = ["| variable | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in FleetSettings.model_fields.items():
        variable = f"{prefix}{name}".upper()
        rows.append(
            f"| `{variable}` | {cell(type_name(field.annotation))} | {cell(default_text(field))} "
            f"| {cell(field.description or '')} |"
        )
    return "\n".join(rows)


# -- CLI --------------------------------------------------------------------------------------------------------
def cli_commands() -> list[tuple[list[str], Any]]:
    import typer

    from fleet.cli import app

    found: list[tuple[list[str], Any]] = []

    def walk(command: Any, path: list[str]) -> None:
        found.append((path, command))
        for name in sorted(getattr(command, "commands", {}) or {}):
            walk(command.commands[name], [*path, name])

    walk(typer.main.get_command(app), [])
    return found


def cli_markdown() -> str:
    from typer.testing import CliRunner

    from fleet.cli import app

    env = {"COLUMNS": "100", "TERM": "dumb", "NO_COLOR": "1"}
    parts = []
    for path, _command in cli_commands():
        result = CliRunner().invoke(app, [*path, "--help"], env=env)
        if result.exit_code != 0:
            raise RuntimeError(f"fleet {' '.join(path)} --help exited {result.exit_code}:\n{result.output}")
        text = "\n".join(line.rstrip() for line in result.output.strip("\n").splitlines())
        title = " ".join(["fleet", *path])
        parts.append(f"## `{title}`\n\n```text\n$ {title} --help\n{text}\n```\n")
    return "\n".join(parts)


# -- REST -------------------------------------------------------------------------------------------------------
@functools.cache  # one app per build: the REST page and openapi.json share it
def openapi_document() -> dict[str, Any]:
    from fleet.producers.gateway import create_app
    from fleet.settings import FleetSettings

    with defaults_only():
        return create_app(FleetSettings()).openapi()


def schema_text(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return "`" + schema["$ref"].rsplit("/", 1)[-1] + "`"
    if "anyOf" in schema:
        return " or ".join(schema_text(s) for s in schema["anyOf"])
    kind = schema.get("type", "object")
    if kind == "array":
        return f"array of {schema_text(schema.get('items', {}))}"
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" for v in schema["enum"])
    return f"`{kind}`"


def operation_markdown(method: str, path: str, op: dict[str, Any]) -> str:
    lines = [f"### `{method.upper()} {path}`", "", f"**{op.get('summary', '')}**", ""]
    if op.get("description"):
        lines += [op["description"].strip(), ""]
    if op.get("security"):
        lines += ["Needs `Authorization: Bearer <API key>` with `FLEET_AUTH=keys`.", ""]
    params = op.get("parameters", [])
    if params:
        lines += ["| parameter | in | type | required | meaning |", "| --- | --- | --- | --- | --- |"]
        for p in params:
            lines.append(
                f"| `{p['name']}` | {p['in']} | {cell(schema_text(p.get('schema', {})))} "
                f"| {'yes' if p.get('required') else 'no'} | {cell(p.get('description', ''))} |"
            )
        lines.append("")
    body = op.get("requestBody", {}).get("content", {})
    if body:
        kinds = ", ".join(f"`{k}`" for k in body)
        first = next(iter(body.values())).get("schema", {})
        title = first.get("title") or schema_text(first)
        lines += [f"Body: {kinds}, {cell(title)}.", ""]
    lines += ["| status | meaning | body |", "| --- | --- | --- |"]
    for status, answer in sorted(op.get("responses", {}).items()):
        content = answer.get("content", {})
        shape = ", ".join(schema_text(v.get("schema", {})) for v in content.values() if v.get("schema")) or ""
        lines.append(f"| {status} | {cell(answer.get('description', ''))} | {cell(shape)} |")
    return "\n".join(lines) + "\n"


def rest_markdown(document: dict[str, Any] | None = None) -> str:
    spec = document or openapi_document()
    tags = {t["name"]: t.get("description", "") for t in spec.get("tags", [])}
    by_tag: dict[str, list[str]] = {name: [] for name in tags}
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            tag = (op.get("tags") or ["other"])[0]
            by_tag.setdefault(tag, []).append(operation_markdown(method, path, op))
    parts = [
        f"Generated from the gateway's OpenAPI document ({spec['info']['title']}, version "
        f"{spec['info']['version']}), also served at `/openapi.json` and [downloadable here](openapi.json)."
    ]
    for tag, operations in by_tag.items():
        if operations:
            parts.append(f"## {tag}\n\n{tags.get(tag, '')}\n\n" + "\n".join(operations))
    return "\n\n".join(parts)


# -- wire schemas -----------------------------------------------------------------------------------------------
def schemas_markdown() -> str:
    from fleet.models import resolve_specs
    from fleet.schemas.export import all_schemas
    from fleet.settings import FleetSettings

    with defaults_only():
        models = FleetSettings().models
    parts = []
    for name, schema in sorted(all_schemas(resolve_specs(models)).items()):
        title = schema.get("title", name)
        lines = [
            f"## `{name}`",
            "",
            f"**{title}**" + (f": {cell(schema['description'])}" if "description" in schema else ""),
            "",
        ]
        required = set(schema.get("required", []))
        props = schema.get("properties", {})
        if props:
            lines += ["| field | type | required | meaning |", "| --- | --- | --- | --- |"]
            for field, sub in props.items():
                lines.append(
                    f"| `{field}` | {cell(schema_text(sub))} | {'yes' if field in required else 'no'} "
                    f"| {cell(sub.get('description', ''))} |"
                )
            lines.append("")
        body = json.dumps(schema, indent=2, sort_keys=True)
        lines += ['??? note "The JSON Schema"', "", "    ```json"]
        lines += ["    " + line for line in body.splitlines()]
        lines += ["    ```", ""]
        parts.append("\n".join(lines))
    return "\n".join(parts)


# -- benchmarks -------------------------------------------------------------------------------------------------
def benchmarks_markdown(results_dir: Path = RESULTS_DIR) -> str:
    """The benchmarks page, from the result files (``benchmarks.report``)."""
    from benchmarks.report import render_markdown

    return render_markdown(results_dir)


# -- includes ---------------------------------------------------------------------------------------------------
def include_markdown(relative: str) -> str:
    text = (ROOT / relative).read_text(encoding="utf-8")
    lines = text.splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return "\n".join(lines).strip() + "\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "settings": settings_markdown,
    "cli": cli_markdown,
    "rest": rest_markdown,
    "schemas": schemas_markdown,
    "benchmarks": benchmarks_markdown,
}


def expand(markdown: str) -> str:
    def replace(match: re.Match[str]) -> str:
        kind, name = match.groups()
        if kind == "include":
            return include_markdown(name)
        if name not in GENERATORS:
            raise ValueError(f"unknown generated section {name!r}; known: {', '.join(GENERATORS)}")
        return GENERATORS[name]()

    return MARKER.sub(replace, markdown)


# -- mkdocs events ----------------------------------------------------------------------------------------------
def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    document = json.dumps(openapi_document(), indent=2)
    files.append(File.generated(config, "reference/openapi.json", content=document))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return expand(markdown)
