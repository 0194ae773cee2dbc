"""The documentation is checked against the code: README.md is the front door and docs/ the
manual. Every relative link resolves (its ``#anchor`` names a heading of the page), every
config key the parsers accept is in the configuration reference (the keys are read from the
parsers' code, so a new key without documentation fails here), every ``prismd`` and
``prismctl`` subcommand (from their argparse parsers) is documented, the complete configs
the guides show pass the config checks, and the pages keep their size and name no commit.
"""

from __future__ import annotations

import argparse
import ast
import re
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from prismd.cli import prismctl
from prismd.cli._prismd import _parser as prismd_parser
from prismd.daemon import check_runnable
from prismd.daemon._config import parse_config
from prismd.limits import LIMIT_TABLE
from tests.conftest import REPO

DOCS = REPO / "docs"
README = REPO / "README.md"
GUIDES = (
    "quickstart",
    "telegram",
    "models",
    "signal",
    "postgresql",
    "several-instances",
    "install",
    "operating",
    "configuration",
    "agents",
    "webchat-protocol",
    "performance",
    "architecture",
    "contributing",
)
PAGES = (README, *sorted(DOCS.glob("*.md")))
MAX_README_LINES = 150
MAX_PAGE_LINES = 500


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def without_code(markdown: str) -> str:
    """The page without fenced code blocks and inline code spans (links there are text)."""
    markdown = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", markdown)


def headings(markdown: str) -> list[str]:
    outside = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6} +(.+?) *#*$", outside, re.M)]


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, markup and punctuation dropped, spaces to
    hyphens, ``-1``, ``-2`` … for repeats."""
    seen: dict[str, int] = {}
    result = set()
    for heading in headings(markdown):
        plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        slug = re.sub(r"[^\w\- ]", "", plain.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def links(markdown: str) -> Iterator[str]:
    for match in re.finditer(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", without_code(markdown)):
        yield match.group(1)


# --------------------------------------------------------------------------- the pages


def test_the_manual_has_its_pages_and_the_index_lists_every_page() -> None:
    present = {path.stem for path in DOCS.glob("*.md")}
    assert {"index", *GUIDES} <= present
    listed = {target.split("#")[0] for target in links(text(DOCS / "index.md"))}
    assert {f"{page}.md" for page in present - {"index"}} <= listed


def test_the_readme_is_a_front_door_and_no_page_is_long() -> None:
    assert len(text(README).splitlines()) <= MAX_README_LINES
    for page in PAGES:
        assert len(text(page).splitlines()) <= MAX_PAGE_LINES, page.name


def test_the_readme_keeps_the_two_commands_and_links_every_guide() -> None:
    readme = text(README)
    block = re.search(r"## The two commands\n+```sh\n(.*?)```", readme, re.S)
    assert block is not None
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert commands == ["make run", "make test"], "CI's .ci/run calls `make test`"
    linked = {target.split("#")[0] for target in links(readme)}
    assert {f"docs/{page}.md" for page in GUIDES} <= linked


def test_every_relative_link_resolves_to_a_file_and_a_heading() -> None:
    broken = []
    checked = 0
    for page in PAGES:
        for target in links(text(page)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # https:, mailto:
            path_part, _, anchor = target.partition("#")
            destination = (page.parent / path_part).resolve() if path_part else page
            checked += 1
            if not destination.exists() or REPO not in (destination, *destination.parents):
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and anchor not in anchors(text(destination)):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert checked > 100
    assert broken == []


def test_the_anchor_rule_is_githubs() -> None:
    page = "# Quick start\n## Check a setup with `prismd doctor`\n## Telegram: the inbox\n"
    page += "## A\n## A\n"
    assert anchors(page) == {
        "quick-start",
        "check-a-setup-with-prismd-doctor",
        "telegram-the-inbox",
        "a",
        "a-1",
    }


COMMIT = re.compile(r"(?<![\w-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")


def test_no_page_names_a_commit() -> None:
    assert COMMIT.search("measured at c4cad5f today")
    assert COMMIT.search("`d87fda2d87fda2d87fda2d87fda2d87fda2d87fd`")
    assert not COMMIT.search("1000000 ms, decade, an ACI 0f0f0f0f-1111-…")
    for page in PAGES:
        found = COMMIT.findall(text(page))
        assert found == [], f"{page.name} names commits {found}: dated notes go to CHANGELOG.md"


# --------------------------------------------------------------------------- config keys

_TABLE_READERS = frozenset(
    {"get_str", "get_int", "get_bool", "get_env_name", "get_address", "choice", "str_list"}
)
_SECTION_READERS = frozenset({"table", "_get"})


def _string(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def table_keys(path: Path) -> tuple[set[str], set[str]]:
    """(keys, sections) a parser module reads through its config table: the string argument
    of every ``table.get_*("key", …)`` / ``choice`` / ``str_list`` call, and of every
    ``table("section")``, ``_get("section", …)`` and ``array_of_tables(root, "section")``."""
    keys: set[str] = set()
    sections: set[str] = set()
    for node in ast.walk(ast.parse(text(path))):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and (name := _string(node.args[0])) is not None:
            if func.attr in _TABLE_READERS:
                keys.add(name)
            elif func.attr in _SECTION_READERS:
                sections.add(name)
        elif (
            isinstance(func, ast.Name)
            and func.id == "array_of_tables"
            and len(node.args) > 1
            and (name := _string(node.args[1])) is not None
        ):
            sections.add(name)
    return keys, sections


def _option_read(node: ast.AST) -> str | None:
    """``"k"`` of ``options["k"]`` or ``options.get("k", …)``."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        return _string(node.slice) if node.value.id == "options" else None
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "options"
        and node.args
    ):
        return _string(node.args[0])
    return None


def agent_option_keys(path: Path) -> set[str]:
    """The options an agent kind's ``validate_*`` functions accept: ``options["k"]``,
    ``options.get("k")``, ``"k" in options``, ``key == "k"`` / ``key in ("k", …)``, and the
    strings of a module-level ``*_KEYS`` set."""
    keys: set[str] = set()
    tree = ast.parse(text(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id.endswith("_KEYS") for t in node.targets
        ):
            keys.update(s for n in ast.walk(node.value) if (s := _string(n)) is not None)
    validators = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and re.fullmatch(r"validate_\w+_options", n.name)
    ]
    for function in validators:
        for inner in ast.walk(function):
            if (name := _option_read(inner)) is not None:
                keys.add(name)
            elif isinstance(inner, ast.Compare):
                parts = [inner.left, *inner.comparators]
                names = {p.id for p in parts if isinstance(p, ast.Name)}
                if names & {"options", "key"}:
                    for part in parts:
                        keys.update(s for n in ast.walk(part) if (s := _string(n)) is not None)
    return keys


def accepted_config_keys() -> tuple[set[str], set[str]]:
    """(keys, sections) the config parser accepts, read from its code."""
    kinds = [p for p in sorted(REPO.glob("adapters/*/_*.py")) if "ConnectionKind(" in p.read_text()]
    parsers = [REPO / "prismd" / "daemon" / "_config.py", *kinds]
    keys: set[str] = set(LIMIT_TABLE)
    sections: set[str] = set()
    for path in parsers:
        found_keys, found_sections = table_keys(path)
        keys |= found_keys
        sections |= found_sections
    for path in sorted((REPO / "prismd" / "agents").rglob("*.py")):
        keys |= agent_option_keys(path)
    return keys, sections


def test_the_key_derivation_sees_what_the_parsers_read() -> None:
    keys, sections = accepted_config_keys()
    # One from each source, so a change that blinds the derivation fails here.
    assert {"state_dir", "pool_size", "webhook_inbox", "receiver_lease_ttl_ms"} <= keys
    assert {"access_token_env", "default_alias", "allow_non_loopback", "uid"} <= keys
    assert {"max_routes", "delay_ms", "vision", "temperature", "factory"} <= keys
    assert {"daemon", "store", "limits", "control", "operators", "connections"} <= sections
    assert {"grants", "agents", "metrics"} <= sections
    assert "url" in keys and "kind" in keys and "id" in keys


def test_every_config_key_is_in_the_configuration_reference() -> None:
    reference = text(DOCS / "configuration.md")
    rows = set()
    for line in reference.splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            rows.update(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", first_cell))
    in_headings = {
        word for heading in headings(reference) for word in re.findall(r"[a-z_][a-z0-9_]*", heading)
    }
    keys, sections = accepted_config_keys()
    assert sorted(keys - rows) == [], "keys without a row in docs/configuration.md"
    assert sorted(sections - in_headings) == [], "tables without a heading"


# --------------------------------------------------------------------------- commands


def subcommands(parser: argparse.ArgumentParser, prefix: str) -> Iterator[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix} {name}"
                yield from subcommands(sub, f"{prefix} {name}")


def test_every_subcommand_is_documented() -> None:
    commands = [
        *subcommands(prismd_parser(), "prismd"),
        *subcommands(prismctl.build_parser(env={}), "prismctl"),
    ]
    assert {"prismd run", "prismd telegram set-webhook", "prismctl reconcile"} <= set(commands)
    manual = "\n".join(text(page) for page in PAGES)
    missing = [c for c in commands if not re.search(rf"{re.escape(c)}(?![\w-])", manual)]
    assert missing == []


# --------------------------------------------------------------------------- examples


def complete_configs() -> Iterator[tuple[str, str]]:
    """(page and file name, TOML) of every block the guides present as a whole file: its
    first line is a comment naming the file (``# prismd.toml: …``)."""
    for page in (README, *sorted(DOCS.glob("*.md"))):
        blocks = re.findall(r"```toml\n(.*?)```", text(page), re.S)
        for number, block in enumerate(blocks, start=1):
            named = re.match(r"# (prismd[\w-]*\.toml):", block.splitlines()[0])
            if named:
                yield f"{page.name} {named.group(1)} (block {number})", block


def secrets_env(block: str) -> dict[str, str]:
    """Each variable a ``*_env`` key of the block names, set (what the guide says to export)."""
    return {name: "set-for-the-test" for name in re.findall(r'_env = "(\w+)"', block)}


COMPLETE = dict(complete_configs())


def test_the_guides_show_complete_configs() -> None:
    pages = {name.split()[0] for name in COMPLETE}
    assert {
        "README.md",
        "quickstart.md",
        "telegram.md",
        "models.md",
        "several-instances.md",
    } <= pages
    assert sum(name.startswith("models.md") for name in COMPLETE) == 4  # OpenAI + 3 local


@pytest.mark.parametrize("name", sorted(COMPLETE))
def test_a_complete_config_passes_check_config(name: str) -> None:
    block = COMPLETE[name]
    config = parse_config(tomllib.loads(block), source=name)
    check_runnable(config, env=secrets_env(block))
    assert config.connections and config.grants and config.agents


def flat(value: Any, where: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out |= flat(item, f"{where}.{key}" if where else key)
        return out
    if isinstance(value, list) and all(isinstance(item, Mapping) for item in value):
        out = {}
        for index, item in enumerate(value, start=1):
            out |= flat(item, f"{where}[{index}]")
        return out
    return {where: value}


def test_two_instances_differ_only_where_they_must() -> None:
    (a_name,) = [name for name in COMPLETE if "several-instances.md prismd-a.toml" in name]
    (b_name,) = [name for name in COMPLETE if "several-instances.md prismd-b.toml" in name]
    a = flat(tomllib.loads(COMPLETE[a_name]))
    b = flat(tomllib.loads(COMPLETE[b_name]))
    assert a.keys() == b.keys()
    differ = {key for key in a if a[key] != b[key]}
    assert differ == {
        "daemon.state_dir",
        "control.socket",
        "connections[1].webhook_listen",
        "connections[2].listen",
        "metrics.listen",
    }
    assert a["store.url"].startswith("postgresql://")


# --------------------------------------------------------------------------- packaging


def test_the_python_range_and_the_licence_agree_everywhere() -> None:
    project = tomllib.loads(text(REPO / "pyproject.toml"))["project"]
    low, high = re.fullmatch(r">=3\.(\d+),<3\.(\d+)", project["requires-python"]).groups()  # type: ignore[union-attr]
    supported = f"Python 3.{low}–3.{int(high) - 1}"
    for page in (README, DOCS / "quickstart.md", DOCS / "install.md"):
        assert supported in text(page), page.name
        assert not re.search(r"Python 3\.\d+\+", text(page)), page.name
    assert project["license"] == "Apache-2.0"
    licence = text(REPO / "LICENSE")
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    assert "END OF TERMS AND CONDITIONS" in licence
