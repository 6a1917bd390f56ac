"""The package's files survive the standard Python .gitignore, and the repository root holds no
importable folder that shadows a name of its own.

A package folder named like a build artefact (``build/``, ``lib/``, ``dist/``, ``eggs/``, ...)
is silently left out of commits by any clone or fork that uses GitHub's Python.gitignore
template, which is how ``fastpipe/build/`` could have gone missing; the builder lives in
``fastpipe/builder/`` for that reason (and so as not to rebind ``fastpipe.build``).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "fastpipe"

# The directory and file patterns of github/gitignore's Python.gitignore that could match a
# source tree (build, packaging and environment folders, byte code).
PYTHON_GITIGNORE = """\
__pycache__/
*.py[cod]
*$py.class
*.so
.Python
build/
develop-eggs/
dist/
downloads/
eggs/
.eggs/
lib/
lib64/
parts/
sdist/
var/
wheels/
share/python-wheels/
*.egg-info/
.installed.cfg
*.egg
MANIFEST
*.manifest
*.spec
htmlcov/
.tox/
.nox/
.cache/
instance/
.webassets-cache
docs/_build/
target/
.ipynb_checkpoints
profile_default/
__pypackages__/
celerybeat-schedule
.env
.venv
env/
venv/
ENV/
env.bak/
venv.bak/
.spyderproject
.spyproject
.ropeproject
site/
.mypy_cache/
.pyre/
.pytype/
cython_debug/
.ruff_cache/
.pypirc
"""


def package_files() -> list[str]:
    """Every file under fastpipe/ (the tree, not only what git tracks: a new folder counts before
    its first commit), relative to the repository root, byte code left out."""
    out = []
    for p in sorted(PKG.rglob("*")):
        rel = p.relative_to(ROOT)
        if p.is_file() and "__pycache__" not in rel.parts and p.suffix not in (".pyc", ".pyo", ".pyd"):
            out.append(rel.as_posix())
    return out


def ignored(paths: list[str], tmp_path: Path) -> list[str]:
    patterns = tmp_path / "Python.gitignore"
    patterns.write_text(PYTHON_GITIGNORE)
    # An empty repository: only the template applies (not this repository's own .gitignore).
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True, capture_output=True)
    run = subprocess.run(
        ["git", "-c", f"core.excludesFile={patterns}", "check-ignore", "--no-index", "--verbose", "--stdin"],
        cwd=repo, input="\n".join(paths) + "\n", capture_output=True, text=True, check=False)
    assert run.returncode in (0, 1), run.stderr        # 0: some path ignored, 1: none
    return run.stdout.splitlines()


@pytest.fixture(scope="module")
def git():
    if shutil.which("git") is None:
        pytest.skip("git is not installed")


def test_python_gitignore_ignores_nothing_in_the_package(git, tmp_path):
    files = package_files()
    assert "fastpipe/__init__.py" in files
    hits = ignored(files, tmp_path)
    assert not hits, "the standard Python .gitignore would drop these package files:\n" + "\n".join(hits)


def test_the_check_catches_a_package_folder_named_like_an_artefact(git, tmp_path):
    """The same check on the layout this replaced, and on a package folder named lib/."""
    old = ["fastpipe/build/api.py", "fastpipe/lib/util.py", "fastpipe/builder/api.py", "fastpipe/kernels/x.py"]
    hits = ignored(old, tmp_path)
    assert [h.rsplit("\t", 1)[-1] for h in hits] == ["fastpipe/build/api.py", "fastpipe/lib/util.py"]


def test_no_package_folder_is_named_like_an_artefact():
    names = {"build", "dist", "lib", "lib64", "eggs", "parts", "sdist", "var", "wheels", "downloads", "env",
             "venv", "develop-eggs", "site", "target", "instance"}
    bad = [p.relative_to(ROOT).as_posix() for p in PKG.rglob("*") if p.is_dir() and p.name in names]
    assert not bad, f"package folders named like build/environment artefacts: {bad}"


def test_repository_root_has_no_top_level_kernels_package():
    """The Triton kernels live in fastpipe/kernels/; a root kernels/ folder was importable as a
    top-level ``kernels`` (Hugging Face's ``kernels`` package name, which transformers probes)."""
    assert not (ROOT / "kernels").exists()
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else '')"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    origin = run.stdout.strip()
    assert not origin or ROOT not in Path(origin).resolve().parents, f"import kernels finds {origin}"
