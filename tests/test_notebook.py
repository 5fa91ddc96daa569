"""The Colab / Kaggle quickstart executes top to bottom against a local folder laid out as the Hub repo (what its
`allow_patterns` download), so it cannot rot; the committed notebook carries its outputs."""

import fnmatch
import os
import shutil
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
PATTERNS = ["*.py", "reap_tools/*.py", "demo/parent/*", "demo/reap40/*"]


def hub_layout(dst: Path) -> Path:
    """The repository's tracked files that the notebook's allow_patterns select, copied (links followed) to dst."""
    for path in ROOT.rglob("*"):
        relative = path.relative_to(ROOT).as_posix()
        if path.is_file() and not relative.startswith((".", "tests/")) and any(
                fnmatch.fnmatch(relative, p) and relative.count("/") == p.count("/") for p in PATTERNS):
            (dst / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dst / relative)
    return dst


def execute(notebook, repo_dir: Path, cwd: Path):
    os.environ["KIMI_K3_REPO_DIR"] = str(repo_dir)
    try:
        NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
                       ).execute()
    finally:
        del os.environ["KIMI_K3_REPO_DIR"]
    return notebook


def test_quickstart_notebook_runs_on_a_hub_layout(tmp_path):
    repo = hub_layout(tmp_path / "repo")
    assert not (repo / "bench").exists() and (repo / "demo" / "reap40" / "modeling_kimi_k3.py").is_file()
    (tmp_path / "cwd").mkdir()
    notebook = execute(nbformat.read(NOTEBOOK, as_version=4), repo, tmp_path / "cwd")
    outputs = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs)
    assert "def read_file(path):\n    with open(path) as f:\n        return f.read()" in outputs
    assert "content: '" in outputs and "truncated_in_reasoning: False" in outputs  # thinking=False: an answer
    assert "OK" in outputs and "most used experts" in outputs


def test_quickstart_defaults_and_saved_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    setup = notebook.cells[1].source
    assert '"Blackfrost-AI/KIMI-K3-CODER-REAP-320-MXFP4"' in setup and "KIMI_K3_REPO_ID" in setup
    assert f"allow_patterns={PATTERNS}".replace("'", '"') in setup
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.outputs for cell in code[1:]), "run the notebook and save it with its outputs"
    assert not any(o.get("output_type") == "error" for cell in code for o in cell.outputs)
