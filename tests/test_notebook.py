"""The Colab / Kaggle quickstart executes top to bottom against the shipped demo, so it cannot rot."""

import os

import nbformat
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_notebook_runs():
    path = os.path.join(ROOT, "notebooks", "quickstart.ipynb")
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": os.path.dirname(path)}})
    client.execute()
    outputs = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs)
    assert "def fibonacci(n):" in outputs
    assert "most used experts" in outputs
