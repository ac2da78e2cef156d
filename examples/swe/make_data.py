"""Pack the SWE-style tasks (examples/swe/tasks/<name>/) into JSONL rows.

    python examples/swe/make_data.py   # writes data/tasks.jsonl

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


def main() -> None:
    rows = [make_row(d) for d in sorted((HERE / "tasks").iterdir()) if d.is_dir()]
    out = HERE / "data"
    out.mkdir(exist_ok=True)
    with (out / "tasks.jsonl").open("w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    print(f"wrote {out / 'tasks.jsonl'} ({len(rows)} tasks)")


if __name__ == "__main__":
    main()
