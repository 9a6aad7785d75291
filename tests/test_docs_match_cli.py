"""The docs say what the command line does: every default the docs give a ``--flag``, as
`` `--budget` (300) ``, `` `--host` (default `127.0.0.1`) `` or `` `--x` (2 s by default) ``,
is the default that ``pipelines``' own parser has for that flag."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from pipelines.cli import build_parser

DOCS = Path(__file__).resolve().parent.parent / "docs"

# `--flag ...` (VALUE), where VALUE is a bare number (with a unit of seconds or not), or says "default".
DOCUMENTED = re.compile(
    r"`(?P<flag>--[a-z][a-z0-9-]*)[^`]*`\s*\("
    r"(?:(?:default:?\s*)`?(?P<said>[^()`,;]+?)`?"
    r"|(?P<number>-?\d+(?:\.\d+)?)(?:\s*s)?(?:\s*by default)?)\)"
)


def cli_defaults() -> dict[str, dict[str, object]]:
    """Each ``--flag`` of every sub-command: {flag: {command: default}}."""
    found: dict[str, dict[str, object]] = {}

    def walk(parser: argparse.ArgumentParser, command: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{command} {name}".strip())
            for option in action.option_strings:
                if option.startswith("--"):
                    found.setdefault(option, {})[command] = action.default

    walk(build_parser(), "")
    return found


def _same(documented: str, default: object) -> bool:
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        try:
            return float(documented) == float(default)
        except ValueError:
            return False
    return documented.strip() == str(default)


def documented_defaults() -> list[tuple[str, int, str, str]]:
    out = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        for m in DOCUMENTED.finditer(text):
            out.append((page.name, text.count("\n", 0, m.start()) + 1, m["flag"], m["said"] or m["number"]))
    return out


def test_the_docs_quote_defaults_at_all():
    # the pattern still finds what the docs write: a test that checks nothing passes for nothing
    assert any(flag == "--top" for _, _, flag, _ in documented_defaults())


@pytest.mark.parametrize(("page", "line", "flag", "said"), documented_defaults(),
                         ids=lambda v: str(v))
def test_every_documented_default_is_the_parsers(page, line, flag, said):
    defaults = cli_defaults().get(flag)
    if defaults is None:
        pytest.skip(f"{flag} is not an option of pipelines (Triton's, or a script's)")
    assert any(_same(said, d) for d in defaults.values()), (
        f"docs/{page}:{line} gives {flag} the default {said!r}, but 'pipelines' has "
        + ", ".join(f"{d!r} ({cmd})" for cmd, d in defaults.items())
        + "; write the parser's default in the docs"
    )
