"""examples/notebooks/quickstart.ipynb runs top to bottom (on the tiny model) in a real kernel."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~35 s: executes the whole notebook (make test-slow)
def test_quickstart_notebook_executes(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("RAYRL_MODEL", str(tiny_model_dir))
    nb = nbformat.read(ROOT / "examples" / "notebooks" / "quickstart.ipynb", as_version=4)
    # run from the notebook's own folder, as a user opening it would
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "examples" / "notebooks")}})
    client.execute()
    outputs = {i: "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
                          for o in c.get("outputs", []))
               for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    text = "\n".join(outputs.values())
    assert "tokens," in text and "trained" in text
    assert "{0: '1'}" in text  # engines.weight_versions(): engine 0 holds policy version 1
    assert "tensor: rank 0 -> http" in text  # the weight plan the notebook printed
