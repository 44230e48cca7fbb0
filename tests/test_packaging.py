"""The package finds its kernels however it is used: from a plain checkout on PYTHONPATH, from the editable
install `make` makes, and from a wheel installed into a fresh virtual environment outside the repository.
Each way runs a kernel that #includes a header of kernels/include/ on the CPU executor."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from importlib import metadata
from pathlib import Path

import pytest

from gpt2_cupy.export import REPOSITORY

# Softmax's kernels include warp.cuh and float_groups.cuh: a kernel that compiles and gives softmax's values
# proves that the .cu file and both headers were found.
RUN_A_KERNEL = r"""
import json, sys
import numpy
import gpt2_cupy
from gpt2_cupy import kernels
from gpt2_cupy.ops.softmax import softmax_forward
x = numpy.random.default_rng(0).normal(size=(5, 37)).astype(numpy.float32)
y = softmax_forward(x)
reference = numpy.exp(x - x.max(-1, keepdims=True))
reference /= reference.sum(-1, keepdims=True)
print(json.dumps({"package": gpt2_cupy.__file__, "kernels": str(kernels.directory()),
                  "error": float(abs(y - reference).max())}))
"""


def run_python(python, code, cwd, **environment):
    """Run `code` with `python` in `cwd` on the CPU executor, with only the given variables beside the basics."""
    keep = {name: os.environ[name] for name in ("HOME", "PATH", "CXX", "GPT2_CUPY_CACHE_DIR", "XDG_CACHE_HOME")
            if name in os.environ}
    result = subprocess.run([str(python), "-c", code], cwd=cwd, capture_output=True, text=True,
                            env={**keep, "GPT2_CUPY_BACKEND": "cpu", **environment})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def copy_of_the_sources(folder):
    """The package, its kernels and the files that describe them, as a checkout holds them."""
    for name in ("gpt2_cupy", "kernels"):
        shutil.copytree(REPOSITORY / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPOSITORY / name, folder / name)
    return folder


def test_a_plain_checkout_on_the_python_path_finds_its_kernels(tmp_path):
    """A copy of the repository's package and kernels, imported through PYTHONPATH only, reads its own kernels/."""
    checkout = copy_of_the_sources(tmp_path / "checkout")
    found = run_python(sys.executable, RUN_A_KERNEL, cwd=tmp_path, PYTHONPATH=str(checkout))
    assert Path(found["package"]).parent == checkout / "gpt2_cupy"
    assert Path(found["kernels"]) == checkout / "kernels"
    assert found["error"] < 1e-6


def editable_install():
    try:
        direct_url = metadata.distribution("gpt2-cupy").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    return json.loads(direct_url or "{}").get("dir_info", {}).get("editable", False)


@pytest.mark.skipif(not editable_install(), reason="gpt2-cupy is not installed in editable mode (make does that)")
def test_the_editable_install_finds_the_checkouts_kernels(tmp_path):
    """Imported from outside the repository, with no PYTHONPATH, the editable install reads kernels/ in place."""
    found = run_python(sys.executable, RUN_A_KERNEL, cwd=tmp_path)
    assert Path(found["package"]).parent == REPOSITORY / "gpt2_cupy"
    assert Path(found["kernels"]) == REPOSITORY / "kernels"
    assert found["error"] < 1e-6


def test_a_wheel_in_a_fresh_environment_carries_its_kernels_and_finds_no_data_of_its_own(tmp_path):
    """The wheel holds every .cu and .cuh file; installed into a new virtual environment outside the
    repository, it runs a kernel, and it looks for corpora only where it is told to."""
    # Built from a copy: setuptools leaves build/ and *.egg-info/ behind in the folder it builds.
    sources = copy_of_the_sources(tmp_path / "sources")
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                            "--wheel-dir", str(wheels), str(sources)], capture_output=True, text=True, cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    wheel, = wheels.glob("gpt2_cupy-*.whl")

    environment = tmp_path / "fresh"
    venv.create(environment, with_pip=False)
    python = environment / "bin" / "python"
    site_packages = Path(subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True).strip())
    shutil.unpack_archive(str(wheel), str(site_packages), format="zip")
    # The project's dependencies (numpy, sentencepiece, ...) come from this environment, after the wheel's
    # own files; gpt2_cupy itself must come from the wheel.
    (site_packages / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")

    installed = {str(p.relative_to(site_packages / "gpt2_cupy" / "kernel_sources"))
                 for p in (site_packages / "gpt2_cupy" / "kernel_sources").rglob("*") if p.is_file()}
    in_repository = {str(p.relative_to(REPOSITORY / "kernels"))
                     for p in (REPOSITORY / "kernels").rglob("*") if p.suffix in (".cu", ".cuh")}
    assert installed == in_repository
    modules = {str(p.relative_to(site_packages)) for p in (site_packages / "gpt2_cupy").rglob("*.py")}
    assert modules == {str(p.relative_to(REPOSITORY)) for p in (REPOSITORY / "gpt2_cupy").rglob("*.py")}

    found = run_python(python, RUN_A_KERNEL, cwd=tmp_path)
    assert Path(found["package"]).parent == site_packages / "gpt2_cupy"
    assert Path(found["kernels"]) == site_packages / "gpt2_cupy" / "kernel_sources"
    assert found["error"] < 1e-6

    no_corpus = run_python(python, r"""
import json
from gpt2_cupy import data
try:
    data.prepare("tinyshakespeare", progress=False)
except FileNotFoundError as error:
    print(json.dumps({"message": str(error)}))
""", cwd=tmp_path)
    assert "--data-dir" in no_corpus["message"] and str(site_packages) not in no_corpus["message"]
