"""The benchmarks and probes run as modules from the repository root, as benchmarks/README.md
says: ``python -m benchmarks.ttft``, ``python -m benchmarks.probes.turn_floor``.

Each once edited sys.path to find sippcache, its siblings or helpers in tests/, each its own
way, so a script ran only from where its author ran it, and a moved helper broke a benchmark no
test imported. Now every module answers ``--help`` (which imports all it imports and builds its
parser, without loading a model or starting a server), none edits sys.path or imports `tests`
(the helpers both share are in harness/), and a probe says what it decided and in which commit.
benchmarks/gpu/ is apart: copied alone to a GPU machine and run there by path (its README).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
PROBES = BENCHMARKS / "probes"
#: Every benchmark's and probe's module name (benchmarks.ttft, benchmarks.probes.turn_floor).
MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for folder in (BENCHMARKS, PROBES)
    for path in folder.glob("*.py")
    if not path.name.startswith("_")
)
#: sys.path changed in place or replaced (reading it, as gpu/run.sh does, is fine).
_SYS_PATH_EDIT = re.compile(r"\bsys\.path\s*(?:\.\s*(?:insert|append|extend|remove)\s*\(|\+?=(?!=)|\[[^]]*\]\s*=(?!=))")
_IMPORTS_TESTS = re.compile(r"^\s*(?:from\s+tests(?:\.|\s)|import\s+tests\b)")


def test_every_benchmark_and_probe_answers_help_as_a_module() -> None:
    assert any(m.startswith("benchmarks.probes.") for m in MODULES), MODULES
    assert any(m.count(".") == 1 for m in MODULES), MODULES

    def helped(module: str) -> tuple[str, int, str]:
        done = subprocess.run(
            [sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        return module, done.returncode, done.stdout + done.stderr

    # A module's --help takes about half a second, most of it imports: a few at a time.
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = list(pool.map(helped, MODULES))
    failed = [f"{module} (exit {code}):\n{out[-2000:]}" for module, code, out in answers if code or "usage:" not in out]
    assert not failed, "\n\n".join(failed)


def test_no_benchmark_edits_sys_path_or_imports_tests() -> None:
    problems = []
    for path in sorted(BENCHMARKS.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            if _SYS_PATH_EDIT.search(line):
                problems.append(f"edits sys.path: {where}")
            if _IMPORTS_TESTS.match(line):
                problems.append(f"imports tests (harness/ holds what tests and benchmarks share): {where}")
    assert not problems, "\n".join(problems)


def test_each_probe_opens_with_what_it_decided_and_the_commit() -> None:
    problems = []
    for path in sorted(PROBES.glob("*.py")):
        if path.name.startswith("_"):
            continue
        opening = (ast.get_docstring(ast.parse(path.read_text())) or "").split("\n\n")[0]
        if not opening.startswith("Decided: ") or not re.search(r"\b[0-9a-f]{7,40}\b", opening):
            problems.append(f"{path.name}: {opening[:120]!r}")
    assert not problems, "a probe's docstring opens with 'Decided: ...' and the commit's hash:\n" + "\n".join(problems)
