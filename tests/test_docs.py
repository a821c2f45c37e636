"""The docs against the tree: README.md and docs/*.md.

Every relative link (``[text](path)``, ``[text](path#anchor)``, ``[text](#anchor)``, images too) names a file or
folder that exists, and an anchor names a heading of that file (GitHub's slugs); every ``pdserve SUBCOMMAND`` and
``make TARGET`` shown in code (fenced blocks and inline code) exists, and every ``--flag`` shown after
``pdserve SUBCOMMAND`` on the same code line is in that subcommand's ``--help``; the README stays a front door of
at most 200 lines (the manual is docs/)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200

# Words after "pdserve " in quoted log lines, not subcommands: the SGLang plugin logs "pdserve kernels on (...)"
# (docs/sglang-workers.md).
NOT_SUBCOMMANDS = {"kernels"}

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# A code span (may wrap inside a paragraph, never across a blank line) or a link / image; scanned left to right,
# so a link inside a code span is no link and a code span inside a link's text stays part of the link.
_SPAN_OR_LINK = re.compile(
    r"(?P<code>(?P<ticks>`+)(?!`)(?P<body>(?:[^`\n]|\n(?![ \t]*\n)|`(?!(?P=ticks)))+?)(?P=ticks)(?!`))"
    r"|(?P<link>!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\((?P<target>[^()\s]+)(?:\s+\"[^\"]*\")?\))"
)
_PDSERVE = re.compile(r"(?<![\w.-])pdserve[ \t]+([a-z][a-z0-9-]*)(?![\w:])(?P<rest>[^|;&]*)")
_MAKE = re.compile(r"(?<![\w.-])make[ \t]+([a-z][a-z0-9_-]*)(?![\w=.-])")
_FLAG = re.compile(r"(?<![\w-])(--[a-zA-Z0-9][\w-]*)")


def split_markdown(text: str) -> tuple[str, list[str]]:
    """(the prose with every fenced block's lines blanked, the fenced blocks' logical lines: a line ending in a
    backslash continues on the next; shell/YAML comments dropped)."""
    prose, code, fence, pending = [], [], None, ""
    for line in text.split("\n"):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            prose.append("")
            continue
        if fence is not None:
            prose.append("")
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip(" `~"):
                fence = None
                if pending:
                    code.append(pending)
                    pending = ""
                continue
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            code.append(re.sub(r"(^|\s)#.*$", "", pending + line))
            pending = ""
            continue
        prose.append(line)
    return "\n".join(prose), code


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: link text only, lowercase, punctuation but '-' and '_' dropped, each space
    a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_markdown(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for line in prose.split("\n"):
        m = _HEADING.match(line)
        if not m:
            continue
        s = slug(m.group(2))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def spans_and_links(prose: str) -> tuple[list[str], list[str]]:
    """(inline code spans, link targets) of the prose."""
    spans, links = [], []
    for m in _SPAN_OR_LINK.finditer(prose):
        if m.group("code"):
            spans.append(" ".join(m.group("body").split()))
        else:
            links.append(m.group("target"))
    return spans, links


def link_problems(doc: Path) -> list[str]:
    """Every relative link of ``doc`` that names no file, or an anchor that is no heading of its file."""
    problems = []
    prose, _ = split_markdown(doc.read_text())
    for target in spans_and_links(prose)[1]:
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            problems.append(f"{doc.name}: link {target!r}: no file {dest}")
            continue
        if anchor:
            if dest.is_dir() or dest.suffix != ".md":
                problems.append(f"{doc.name}: link {target!r}: an anchor into a file that is not markdown")
            elif anchor not in anchors(dest):
                problems.append(f"{doc.name}: link {target!r}: no heading with anchor #{anchor} in {dest.name}")
    return problems


def code_lines(doc: Path) -> list[str]:
    prose, fenced = split_markdown(doc.read_text())
    return fenced + spans_and_links(prose)[0]


def shown_commands(docs: list[Path]) -> tuple[dict[str, dict[str, set[str]]], dict[str, set[str]]]:
    """({subcommand: {flag: docs showing it}}, {make target: docs showing it}) over every code line."""
    subs: dict[str, dict[str, set[str]]] = {}
    targets: dict[str, set[str]] = {}
    for doc in docs:
        for line in code_lines(doc):
            for m in _PDSERVE.finditer(line):
                if m.group(1) in NOT_SUBCOMMANDS:
                    continue
                flags = subs.setdefault(m.group(1), {})
                flags.setdefault("", set()).add(doc.name)
                for flag in _FLAG.findall(m.group("rest")):
                    flags.setdefault(flag, set()).add(doc.name)
            for m in _MAKE.finditer(line):
                targets.setdefault(m.group(1), set()).add(doc.name)
    return subs, targets


def makefile_targets() -> set[str]:
    out = set()
    for line in (ROOT / "Makefile").read_text().split("\n"):
        m = re.match(r"^([A-Za-z0-9_.-]+(?:[ \t]+[A-Za-z0-9_.-]+)*)[ \t]*:(?!=)", line)
        if m and not m.group(1).startswith("."):
            out.update(m.group(1).split())
    return out


def test_every_relative_link_and_anchor_exists():
    problems = [p for doc in DOCS for p in link_problems(doc)]
    assert not problems, "\n".join(problems)


def test_the_link_check_catches_broken_links(tmp_path):
    (tmp_path / "other.md").write_text(
        "# Other page\n\n## The P:D split: `pdserve plan-split`\n\n```\n# not a heading\n```\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Doc\n\n[ok](other.md#the-pd-split-pdserve-plan-split), [ok](#doc), `[not a link](nowhere.md)`,\n"
        "[missing](nowhere.md), [bad anchor](other.md#not-a-heading), [bad local](#nope), [web](https://x.invalid)\n"
    )
    problems = link_problems(doc)
    assert len(problems) == 3, problems
    assert "nowhere.md" in problems[0] and "#not-a-heading" in problems[1] and "#nope" in problems[2]


def test_shown_commands_parse(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Run `pdserve up [CONFIG] [--port N]`, then `make serve CONFIG=x.yaml`; logs say `pdserve: ready`,\n"
        "`pdserve mxfp4_moe: ...` and `pdserve_router_errors_total`.\n\n"
        "```bash\npdserve bench --base-url URL \\\n    --request-rate 1,2  # --not-a-flag\nmake test-fast\n```\n"
    )
    subs, targets = shown_commands([doc])
    assert {s: set(f) for s, f in subs.items()} == {"up": {"", "--port"}, "bench": {"", "--base-url", "--request-rate"}}
    assert set(targets) == {"serve", "test-fast"}


def test_every_shown_pdserve_command_make_target_and_flag_exists():
    subs, targets = shown_commands(DOCS)
    assert "router" in subs and "serve" in targets  # the parse found the docs' commands at all
    procs = {
        sub: subprocess.Popen([sys.executable, "-m", "pd.cli", sub, "--help"], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for sub in sorted(subs)
    }
    problems = []
    for sub, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        shown_in = ", ".join(sorted(subs[sub][""]))
        if proc.returncode != 0:
            problems.append(f"`pdserve {sub} --help` exited {proc.returncode} (shown in {shown_in}):\n{out[-2000:]}")
            continue
        for flag, where in sorted(subs[sub].items()):
            if flag and flag not in ("--help", "-h") and not re.search(re.escape(flag) + r"(?![\w-])", out):
                problems.append(f"`pdserve {sub} {flag}` (shown in {', '.join(sorted(where))}): "
                                f"not in `pdserve {sub} --help`")
    known = makefile_targets()
    for target, where in sorted(targets.items()):
        if target not in known:
            problems.append(f"`make {target}` (shown in {', '.join(sorted(where))}): no such Makefile target")
    assert not problems, "\n".join(problems)


def test_the_readme_is_a_front_door():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}: the manual is docs/)"
