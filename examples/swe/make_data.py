"""Pack the SWE-style tasks into JSONL rows: the repository tasks and the starter tasks.

    python examples/swe/make_data.py   # writes data/tasks.jsonl and data/starter.jsonl

``data/tasks.jsonl``: the repository tasks in ``tasks/<name>/``, each a small package with a bug, a
visible failing test and hidden tests; for a coding model (README.md: the GPU config).

``data/starter.jsonl``: one-line bugs in one-line files (``STARTER`` below), each issue naming the wrong
expression and the right one, in the form of the ``write_file`` tool's worked examples. They are for
SmolLM2-135M-Instruct on a CPU, which never called a tool on the repository tasks: it reads the file,
writes it back fixed and says what it changed, right often enough for GRPO to have groups with both
rewards (README.md has the counts). The reward is the same: hidden tests run on the files it left.

Each task folder holds ``issue.md`` (the bug report the agent gets), ``repo/`` (a small Python package with
the bug and a visible failing test) and ``hidden/`` (the tests the reward runs). A row ships the
repository as ``metadata.files`` (written into the episode's sandbox before the agent starts; no git
history, so there is no fix to mine), asks for the files back (``metadata.collect_files``), and carries the
hidden tests for the reward only (``metadata.hidden_tests``: never written into the agent's sandbox;
rayrl/rewards/hidden_tests.py runs them on the agent's files in a fresh sandbox).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
INSTRUCTIONS = ("The repository is in your working directory. Read the code, fix the bug by rewriting the "
                "file with write_file, then reply with one line saying what you changed.")


def texts(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def make_row(task_dir: Path) -> dict:
    issue = (task_dir / "issue.md").read_text().strip()
    question = f"{issue}\n\n{INSTRUCTIONS}"
    return {"id": f"swe-{task_dir.name}", "prompt": question,
            "metadata": {"question": question, "task": task_dir.name, "files": texts(task_dir / "repo"),
                         "collect_files": True, "hidden_tests": texts(task_dir / "hidden")}}


# (name, signature, the buggy expression, the right one, a hidden check on the fixed function)
STARTER = [
    ("double", "double(n)", "n + 2", "n * 2", "double(5) == 10 and double(0) == 0 and double(-3) == -6"),
    ("shout", "shout(s)", "s.lower()", "s.upper()", "shout('Hi there') == 'HI THERE'"),
    ("area", "area(w, h)", "w + h", "w * h", "area(3, 4) == 12 and area(2, 5) == 10"),
    ("last", "last(items)", "items[0]", "items[-1]", "last([1, 2, 3]) == 3 and last(['a']) == 'a'"),
    ("even", "is_even(n)", "n % 2 == 1", "n % 2 == 0", "is_even(4) and not is_even(7) and is_even(0)"),
    ("bigger", "bigger(a, b)", "min(a, b)", "max(a, b)", "bigger(2, 9) == 9 and bigger(7, 1) == 7"),
    ("sub", "sub(a, b)", "b - a", "a - b", "sub(9, 4) == 5 and sub(1, 3) == -2"),
    ("half", "half(n)", "n * 2", "n / 2", "half(10) == 5 and half(3) == 1.5"),
    ("neg", "neg(n)", "n", "-n", "neg(4) == -4 and neg(-2) == 2"),
    ("square", "square(n)", "n * 2", "n * n", "square(3) == 9 and square(5) == 25"),
    ("first", "first(items)", "items[-1]", "items[0]", "first([1, 2, 3]) == 1 and first(['a']) == 'a'"),
    ("smaller", "smaller(a, b)", "max(a, b)", "min(a, b)", "smaller(2, 9) == 2 and smaller(7, 1) == 1"),
]


def make_starter_row(name: str, signature: str, wrong: str, right: str, check: str) -> dict:
    function = signature.split("(")[0]
    question = f"{signature} in {name}.py returns {wrong}. Change it to return {right}."
    hidden = (f"import unittest\n\nfrom {name} import {function}\n\n\n"
              f"class FixedTest(unittest.TestCase):\n    def test_fixed(self):\n        self.assertTrue({check})\n")
    files = {f"{name}.py": f"def {signature}: return {wrong}\n"}
    return {"id": f"swe-starter-{name}", "prompt": question,
            "metadata": {"question": question, "task": name, "files": files, "collect_files": True,
                         "hidden_tests": {f"test_{name}.py": hidden}}}


def write_rows(path: Path, rows: list[dict]) -> None:
    with path.open("w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    print(f"wrote {path} ({len(rows)} tasks)")


def main() -> None:
    out = HERE / "data"
    out.mkdir(exist_ok=True)
    write_rows(out / "tasks.jsonl", [make_row(d) for d in sorted((HERE / "tasks").iterdir()) if d.is_dir()])
    write_rows(out / "starter.jsonl", [make_starter_row(*task) for task in STARTER])


if __name__ == "__main__":
    main()
