"""The documents hold together: every link between README.md, BENCHMARKS.md and docs/ lands on a file and a heading
that exist, BENCHMARKS.md's contents list every topic, docs/architecture.md names every package and module of
src/xgblora and states the layers tests/test_layers.py enforces, the commands BENCHMARKS.md quotes parse as their
programs' own parsers read them, and the pages stay within their lengths."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
from conftest import load_benchmark
from test_docs import block_commands, shell_blocks
from test_layers import LAYERS, SRC

from xgblora import cli

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def anchor(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {anchor(h) for h in re.findall(r"^#{1,6} (.+)$", _prose(page.read_text(encoding="utf-8")), re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_lands_on_a_file_and_heading_that_exist(page):
    for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: link to {target}: no such file"
        if fragment:
            assert fragment in anchors(linked), f"{page.name}: link to {target}: no such heading in {linked.name}"


def test_the_benchmarks_contents_list_every_topic():
    text = (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")
    contents, body = text.split("## Contents", 1)[1].split("\n## ", 1)
    listed = set(re.findall(r"\]\(#([^)]+)\)", contents))
    topics = {anchor(h) for h in re.findall(r"^#{2,3} (.+)$", _prose("## " + body), re.M)}
    assert topics and topics <= listed, f"not in the contents: {sorted(topics - listed)}"


def test_the_pages_stay_within_their_lengths():
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 250
    assert len((REPO / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()) <= 1200


def test_architecture_names_every_package_and_module():
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    packages = sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").exists())
    modules = sorted({p.name for p in SRC.rglob("*.py") if p.name != "__init__.py"})
    assert [p for p in packages if f"`{p}/`" not in text] == []
    assert [m for m in modules if f"`{m}`" not in text] == []


def test_architecture_states_the_layers_the_import_test_enforces():
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"## Layers\n.*?```\n(.*?)```", text, re.S).group(1)
    stated = [tuple(unit.strip().rstrip("/") for unit in line.split(",")) for line in block.strip().splitlines()]
    assert stated == LAYERS


def test_no_page_speaks_of_issue_numbers():
    for page in PAGES:
        assert not re.search(r"\bissues?\s+#?\d+", page.read_text(encoding="utf-8"), re.I), page.name


class _Parsed(Exception):
    """Raised in place of running a benchmark once its parser has read the command line."""


def _quoted_commands(page: Path) -> list[str]:
    return [c for block in shell_blocks(page.read_text(encoding="utf-8")) for c in block_commands(block)]


BENCH_COMMANDS = _quoted_commands(REPO / "BENCHMARKS.md")


def test_benchmarks_quote_both_kinds_of_command():
    assert sum(c.startswith("xgblora ") for c in BENCH_COMMANDS) >= 10
    assert sum("python benchmarks/" in c for c in BENCH_COMMANDS) >= 20


def test_the_quoted_xgblora_commands_parse(capsys):
    parser = cli.build_parser()  # built once: it takes seconds
    refused = []
    for command in (c for c in BENCH_COMMANDS if c.startswith("xgblora ")):
        try:
            parser.parse_args(shlex.split(command)[1:])
        except SystemExit:  # an unknown flag or choice
            refused.append(f"{command}: {capsys.readouterr().err.strip().splitlines()[-1]}")
    assert refused == []


@pytest.mark.parametrize("command", [c for c in BENCH_COMMANDS if "python benchmarks/" in c])
def test_a_quoted_benchmark_command_parses(command, monkeypatch):
    words = shlex.split(command)
    words = words[words.index("python") + 1:]  # `nice -n 10 python ...` as `python ...`
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr("sys.argv", words)
    module = load_benchmark(Path(words[0]).stem)
    with pytest.raises(_Parsed):
        module.main()
