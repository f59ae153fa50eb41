"""The pages a reader opens first: README.md, CONTRIBUTING.md, CHANGELOG.md and docs/.

- every relative link and ``#anchor`` resolves, as GitHub renders the anchors;
- every figure in the README's results table, and in its "Will it help me?" table, is in the
  section of docs/benchmarks.md that its row (its cell) links to, and that section spells the
  command that produced it (the README links there rather than repeating how it was measured);
- docs/benchmarks.md is the summary (a section per benchmark script with its command, the
  date of its last run and a link to its history) and docs/benchmarks-log.md keeps the history;
- README's test command is the one `.ci/run` runs, and the chart the README shows is the
  generated one, with the command that regenerates it;
- every page with a `sippcache` command is one tests/test_doc_commands.py runs, and every
  `python -m benchmarks.NAME` a page spells names a module that takes the options given.

These read files only: no model, no server.
"""

from __future__ import annotations

import re
import shlex
import unicodedata
from functools import cache
from pathlib import Path

import pytest

from tests.test_doc_commands import PAGES as COMMAND_PAGES
from tests.test_doc_commands import shell_blocks

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
BENCHMARKS_LOG = ROOT / "docs" / "benchmarks-log.md"
#: What names a benchmark's (or a probe's) command on a page.
BENCHMARK_COMMAND = "python -m benchmarks."
#: Every page whose links are checked.
PAGES = [README, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
#: [text](target) and ![alt](target); a target ends at whitespace or the closing parenthesis.
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"`[^`]*`")


def prose(page: Path) -> list[tuple[int, str]]:
    """(line number, line) of the page outside fenced code blocks, inline code removed."""
    lines: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but `-` and `_`
    removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFC", text).lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every anchor the page has: its headings' (numbered -1, -2 where they repeat, as GitHub
    does) and any explicit `<a id=...>` / `<a name=...>`."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose(page):
        heading = _HEADING.match(line)
        if heading:
            base = slug(heading.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line))
    return frozenset(found)


def links(page: Path) -> list[tuple[int, str]]:
    out = []
    for number, line in prose(page):
        for target in _LINK.findall(_INLINE_CODE.sub("", line)):
            out.append((number, target))
    return out


def test_every_page_exists() -> None:
    missing = [str(p.relative_to(ROOT)) for p in PAGES if not p.is_file()]
    assert not missing, missing


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    broken = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{page.name}:{number}: {target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{page.name}:{number}: {target}: no heading with that anchor in {where.name}")
    assert not broken, "\n".join(broken)


def test_slugs_as_github_makes_them() -> None:
    assert slug("Serving with llama.cpp's llama-server") == "serving-with-llamacpps-llama-server"
    assert slug("`sippcache proxy`: the cache in front") == "sippcache-proxy-the-cache-in-front"
    assert slug("Sliding-window, recurrent and hybrid models") == "sliding-window-recurrent-and-hybrid-models"
    assert slug("Route 1: `KVBackend` over a map") == "route-1-kvbackend-over-a-map"


def readme_table(title: str) -> list[str]:
    """The rows of the first table under the README's heading `title` (e.g. ``## Results``),
    its header and rule left out."""
    rows: list[str] = []
    inside = False
    for _, line in prose(README):
        if line.startswith("## "):
            if inside and rows:
                break
            inside = line.strip() == title
            continue
        if inside and line.startswith("|"):
            rows.append(line)
        elif inside and rows:
            break
    return rows


def cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


#: A figure: a number with a unit, or a ratio such as "43x" or "3.36x".
_FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:\s?(?:ms|µs|s|MB|GB|GiB|tokens/s|tok/s|%|U)|x)(?![\w/])")


def figures(text: str) -> list[str]:
    return [" ".join(f.split()) for f in _FIGURE.findall(_INLINE_CODE.sub("", text).replace("**", ""))]


def flat(text: str) -> str:
    return " ".join(text.split()).replace("**", "")


def holds(section: str, figure: str) -> bool:
    """The section spells the figure as a number of its own: "0.24 s" is not found in "10.24 s"."""
    return re.search(rf"(?<![\d.,]){re.escape(figure)}(?![\d])", flat(section)) is not None


def figures_against_their_sections(text: str, where: str) -> list[str]:
    """Problems with `text` (a row or a cell): it links to one section of docs/benchmarks.md,
    that section holds each of its figures and spells a command."""
    targets = [t for t in _LINK.findall(text) if t.startswith("docs/benchmarks.md#")]
    if len(targets) != 1:
        return [f"{where} links to {len(targets)} sections of docs/benchmarks.md, not one: {text}"]
    anchor = targets[0].partition("#")[2]
    section = benchmark_sections().get(anchor)
    if section is None:
        return [f"{where}: no section #{anchor} in docs/benchmarks.md"]
    problems = [
        f"{figure!r} ({where}: {text}) is not in the section #{anchor} of docs/benchmarks.md"
        for figure in figures(text)
        if not holds(section, figure)
    ]
    if not re.search(r"(python -m benchmarks(\.\w+)+|sippcache demo|bash benchmarks/gpu/)", section):
        problems.append(f"#{anchor}: the section spells no command")
    return problems


def test_every_readme_figure_is_in_the_section_its_row_links_to() -> None:
    """The README's results table: at most 8 rows of scenario | without | with | setup, each
    linking to one section of docs/benchmarks.md that holds every figure of the row (its own
    section, not anywhere on the page) and spells the command that produced them."""
    header, _, *rows = readme_table("## Results")
    assert cells(header) == ["scenario", "without sippcache", "with sippcache", "setup"], header
    assert 5 <= len(rows) <= 8, f"README.md's results table has {len(rows)} rows, not 5 to 8"
    problems = []
    for row in rows:
        assert len(cells(row)) == 4, f"a results row without its four columns: {row}"
        assert figures(row), f"a results row without a figure: {row}"
        problems += figures_against_their_sections(row, "row")
    assert not problems, "\n".join(problems)


def test_every_will_it_help_figure_is_in_the_section_its_cell_links_to() -> None:
    """The README's "Will it help me?" table: a row per setup (the two CPU ways, Apple Silicon,
    an NVIDIA GPU), a column per workload; a cell with a figure links to the section of
    docs/benchmarks.md that holds it, and a cell without one says what is not measured."""
    header, _, *rows = readme_table("## Will it help me?")
    columns = " ".join(cells(header)[1:])
    for workload in ("restart", "slots", "shared", "agent", "live"):
        assert workload in columns, f"no column for {workload!r}: {header}"
    setups = [cells(row)[0] for row in rows]
    for setup in ("llama-cpp-python", "llama-server", "Apple Silicon", "NVIDIA GPU"):
        assert any(setup in s for s in setups), f"no row for {setup!r}: {setups}"
    problems = []
    for row in rows:
        setup, *by_workload = cells(row)
        assert len(by_workload) == len(cells(header)) - 1, row
        for cell in by_workload:
            if figures(cell):
                problems += figures_against_their_sections(cell, f"cell of {setup!r}")
            elif "not measured" not in cell and "nothing to gain" not in cell:
                problems.append(f"a cell of {setup!r} with no figure says neither 'not measured' nor why: {cell}")
    assert not problems, "\n".join(problems)


def benchmark_sections(level: int = 1, page: Path = BENCHMARKS, leaves: bool = False) -> dict[str, str]:
    """A benchmarks page's sections of heading `level` or deeper, by anchor, each with its text
    up to the next heading of the same or a higher level (`leaves`: only those with no heading
    below them)."""
    lines = page.read_text().splitlines()
    headings = []
    fenced = False
    for i, line in enumerate(lines):
        if _FENCE.match(line):
            fenced = not fenced
        heading = None if fenced else _HEADING.match(line)
        if heading:
            headings.append((i, len(heading.group(1)), slug(heading.group(2))))
    out = {}
    for k, (i, depth, anchor) in enumerate(headings):
        if depth < level or (leaves and k + 1 < len(headings) and headings[k + 1][1] > depth):
            continue
        end = next((j for j, d, _ in headings[k + 1 :] if d <= depth), len(lines))
        out[anchor] = "\n".join(lines[i:end])
    return out


_DATE = re.compile(r"20\d\d-\d\d-\d\d")


def test_each_benchmark_has_a_section_with_date_machine_and_goals() -> None:
    """docs/benchmarks.md, the summary: a section per module in benchmarks/ and benchmarks/probes/,
    naming its command, with the date of its last run, listed in the table of goals, and linking
    to the section of the same name in docs/benchmarks-log.md, which keeps every run (each section
    dated there too). Both pages name the machines; the summary stays a summary."""
    scripts = benchmark_modules()
    for page in (BENCHMARKS, BENCHMARKS_LOG):
        text = page.read_text()
        missing = [s for s in scripts if not re.search(rf"python -m {re.escape(s)}(?![\w.])", text)]
        assert not missing, f"no command for {missing} in {page.name}"
        undated = [
            anchor
            for anchor, section in benchmark_sections(level=2, page=page).items()
            if BENCHMARK_COMMAND in section and not _DATE.search(section)
        ]
        assert not undated, f"sections of {page.name} with a command but no date: {undated}"
        assert "cores" in text and "Xeon" in text, page.name
    summary = BENCHMARKS.read_text()
    assert len(summary.splitlines()) <= 420, "docs/benchmarks.md is the summary: the history goes to the log"
    table = summary.partition("## Where each goal stands")[2].partition("\n## ")[0]
    assert table.count("\n|") >= len(scripts), "the table of goals has fewer rows than benchmarks/ has scripts"
    listed = set(re.findall(r"\]\(#([\w-]+)\)", table))
    log_anchors = anchors(BENCHMARKS_LOG)
    problems = []
    for anchor, section in benchmark_sections(level=2, leaves=True).items():
        if BENCHMARK_COMMAND not in section:
            continue
        if anchor not in listed:
            problems.append(f"#{anchor} is not in the table of goals")
        if anchor not in log_anchors or f"(benchmarks-log.md#{anchor})" not in section:
            problems.append(f"#{anchor} does not link to its history, benchmarks-log.md#{anchor}")
    assert not problems, "\n".join(problems)


def test_readme_test_command_is_what_ci_runs() -> None:
    """README's command 2 is, byte for byte, the command `.ci/run` runs."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = next(line for line in ci if "pytest" in line)
    readme = [line for _, line in shell_blocks(README)]
    assert command in readme, "README.md's command 2 differs from .ci/run's"


def test_the_chart_is_generated_and_shown() -> None:
    """The README shows the chart benchmarks/ttft_chart.py writes, and the pages spell the command."""
    chart = ROOT / "docs" / "ttft.svg"
    assert chart.is_file() and (ROOT / "docs" / "ttft.json").is_file()
    readme = README.read_text()
    assert "](docs/ttft.svg)" in readme
    for page in (README, BENCHMARKS):
        assert "python -m benchmarks.ttft_chart" in page.read_text(), page.name
    assert "<svg" in chart.read_text()[:2000]


def test_pages_with_sippcache_commands_are_the_ones_run() -> None:
    """tests/test_doc_commands.py runs README.md's and docs/*.md's commands; a page outside those
    (CONTRIBUTING.md, CHANGELOG.md) must not spell a `sippcache` command it would not run."""
    for page in PAGES:
        spelled = [
            (n, line)
            for n, line in shell_blocks(page)
            for part in re.split(r"&&|\|\||;", line)
            if (words := shlex.split(part, comments=True)) and Path(words[0]).name == "sippcache"
        ]
        if spelled:
            assert page in COMMAND_PAGES, f"{page.name} spells {spelled} but test_doc_commands.py does not run it"


#: A module's name in lower case: `python -m benchmarks.NAME` in prose names none.
_BENCH_COMMAND = re.compile(r"python -m (benchmarks(?:\.[a-z_][a-z0-9_]*)+)((?: [\[\]\w,.:/=|-]+)*)")


def benchmark_modules() -> list[str]:
    """Every benchmark's and probe's module name (benchmarks.ttft, benchmarks.probes.turn_floor)."""
    folder = ROOT / "benchmarks"
    paths = [*folder.glob("*.py"), *(folder / "probes").glob("*.py")]
    return sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in paths if not p.name.startswith("_"))


def test_benchmark_commands_name_real_scripts_and_options() -> None:
    """Every `python -m benchmarks.NAME --option` in the pages names a module that exists and
    an option its argument parser declares."""
    problems = []
    for page in PAGES:
        text = " ".join(page.read_text().split())
        for script, rest in _BENCH_COMMAND.findall(text):
            path = ROOT.joinpath(*script.split(".")).with_suffix(".py")
            if not path.is_file():
                problems.append(f"{page.name}: {script} does not exist")
                continue
            source = path.read_text()
            for option in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest):
                if f'"{option}"' not in source:
                    problems.append(f"{page.name}: {script} has no option {option}")
    assert not problems, "\n".join(problems)
