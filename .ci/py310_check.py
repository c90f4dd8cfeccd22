"""README promises Python 3.10+, and CI runs the suite on 3.11 only. This job keeps the code
3.10-clean: every file compiles under a real Python 3.10 when one is found (pyenv's, or
python3.10 on PATH), and no module reaches for a 3.11-only standard-library name.

    python .ci/py310_check.py          # exit 1 naming each file:line that would break 3.10
"""

from __future__ import annotations

import ast
import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("speedtronic", "tests", "benchmarks", "examples")

#: Standard-library names that arrived in 3.11 (module, attribute or None for the module).
NEW_IN_311 = {("tomllib", None), ("datetime", "UTC"), ("enum", "StrEnum"), ("typing", "Self"),
              ("typing", "LiteralString"), ("typing", "Never"), ("typing", "assert_never"),
              ("typing", "reveal_type"), ("asyncio", "TaskGroup"), ("asyncio", "timeout"),
              ("builtins", "ExceptionGroup"), ("builtins", "BaseExceptionGroup")}


def _files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def _new_names(path: Path) -> list[str]:
    """``file:line name`` for each 3.11-only name the file imports or uses."""
    found = []
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    except SyntaxError as exc:  # not even this interpreter's syntax: pytest would say so too
        return [f"{path.relative_to(ROOT)}:{exc.lineno} syntax error: {exc.msg}"]
    for node in ast.walk(tree):
        hits: list[tuple[str, str | None]] = []
        if isinstance(node, ast.Import):
            hits = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            hits = [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            hits = [(node.value.id, node.attr)]
        elif isinstance(node, ast.Name) and node.id in ("ExceptionGroup", "BaseExceptionGroup"):
            hits = [("builtins", node.id)]
        elif isinstance(node, ast.TryStar):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} except*")
        for module, name in hits:
            if (module, name) in NEW_IN_311 or (module, None) in NEW_IN_311:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {module}"
                             + (f".{name}" if name else ""))
    return found


#: Run by Python 3.10 over every file: one ``file:line message`` per file it cannot compile.
_COMPILE_EACH = """
import sys
for f in sys.argv[1:]:
    try:
        compile(open(f, encoding="utf-8").read(), f, "exec")
    except SyntaxError as e:
        print(f"{f}:{e.lineno} {e.msg}")
"""


def _python310() -> str | None:
    """A working Python 3.10: pyenv's install itself (its shim on PATH refuses to run a
    version the folder has not selected), else python3.10 on PATH if it runs."""
    candidates = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10*/bin/python")))
    candidates += [p for p in [shutil.which("python3.10")] if p]
    for candidate in candidates:
        probe = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == "(3, 10)":
            return candidate
    return None


def main() -> int:
    files = _files()
    problems = [hit for f in files for hit in _new_names(f)]
    py310 = _python310()
    if py310 is None:
        print("py310: no Python 3.10 here; checked 3.11-only names only")
    else:
        proc = subprocess.run([py310, "-c", _COMPILE_EACH, *map(str, files)],
                              capture_output=True, text=True)
        problems += [f"Python 3.10 cannot compile {line}" for line in proc.stdout.splitlines()]
        if proc.returncode != 0 and not proc.stdout:
            problems.append(f"Python 3.10 ({py310}) failed: {proc.stderr.strip()[-300:]}")
    for line in problems:
        print(f"py310: {line}", file=sys.stderr)
    print(f"py310: {len(files)} files, {'compiled by ' + py310 if py310 else 'names only'}: "
          f"{'FAILED' if problems else 'ok'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
