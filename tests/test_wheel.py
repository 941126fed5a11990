"""The wheel as a user gets it: built from a clean copy of the tree, installed into a fresh virtual environment
outside the repository, it runs the 2-rank smoke job with a shipped profile named without a path, `python -m
dtrain.train` with one named `profiles/<name>.yaml` (the README's form), builds the NCCL tuner plugin from its installed
source, and installs beside another distribution that ships a top-level `common`.

The fresh environment sees this one's site-packages (torch and the other dependencies, already installed) through a
`.pth` line; that adds the folder to `sys.path` without running the `.pth` files in it, so this checkout's editable
install is not on the path and every `dtrain` import must come from the wheel."""

import ctypes
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def run(cmd, cwd, env=None, timeout=300):
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


def clean_copy(dst: Path) -> Path:
    """The files git tracks or would track (no .venv, build outputs or caches), as a clean clone has them."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dst / name)
    return dst


def other_common_wheel(tmp: Path) -> Path:
    """A distribution `othercommon` whose top-level package is `common`, as many projects ship one."""
    src = tmp / "othercommon"
    (src / "common").mkdir(parents=True)
    (src / "common" / "__init__.py").write_text("OWNER = 'othercommon'\n")
    (src / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools>=64"]\n'
                                        'build-backend = "setuptools.build_meta"\n[project]\nname = "othercommon"\n'
                                        'version = "1.0"\n[tool.setuptools]\npackages = ["common"]\n')
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"),
         str(src)], cwd=tmp)
    return next((tmp / "dist").glob("othercommon-*.whl"))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python of the fresh environment, its environment variables, a folder outside the repository, the wheel)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = clean_copy(tmp / "src")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"),
         str(src)], cwd=tmp)
    wheel = next((tmp / "dist").glob("dtrain-*.whl"))
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    python = venv / "bin" / "python"
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp)
    (Path(purelib.stdout.strip()) / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel),
         str(other_common_wheel(tmp))], cwd=tmp)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}:{env['PATH']}", XDG_CACHE_HOME=str(tmp / "cache"), OMP_NUM_THREADS="1")
    work = tmp / "work"
    work.mkdir()
    return python, env, work, wheel


def test_the_wheel_holds_the_profiles_the_plugin_source_and_the_licence(installed):
    names = zipfile.ZipFile(installed[3]).namelist()
    assert {"dtrain/profiles/smoke.yaml", "dtrain/profiles/sweeps/smoke.yaml", "dtrain/profiles/testbed/1gbit.yaml",
            "dtrain/collectives/tuner/dtrain_tuner.c", "dtrain/py.typed"} <= set(names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    meta = zipfile.ZipFile(installed[3]).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: MIT" in meta and "Provides-Extra: analysis" in meta
    assert not any(n.split("/")[0] in ("common", "collectives", "analysis") for n in names)  # one namespace


def test_imports_come_from_the_wheel_beside_another_common(installed):
    python, env, work, _ = installed
    r = run([str(python), "-c", "import common, dtrain, dtrain.common.errors, dtrain.engine.train; "
             "print(common.OWNER, dtrain.__version__, dtrain.__file__)"], cwd=work, env=env)
    owner, version, where = r.stdout.split()
    assert owner == "othercommon" and str(work.parent / "venv") in where and str(REPO) not in where
    assert run([str(work.parent / "venv" / "bin" / "dtrain"), "--version"], cwd=work, env=env).stdout.strip() == \
        f"dtrain {version}"


def test_the_smoke_job_runs_from_the_installed_wheel(installed):
    python, env, work, _ = installed
    r = run([str(python), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dtrain",
             "train", "--profile", "smoke", "--run-dir", "run", "--set", "train.max_steps=6", "--set",
             "train.val_every=0", "--set", "eval.at_end=false"], cwd=work, env=env)
    print(r.stdout[-500:])
    steps = (work / "run" / "steps.jsonl").read_text().splitlines()
    assert len(steps) == 6 and "done: steps=6" in r.stdout + r.stderr


def test_the_readme_s_form_finds_the_shipped_profile_from_the_installed_wheel(installed):
    """`-m dtrain.train --profile profiles/<name>.yaml` where the working directory holds no such file: the profile
    shipped in the wheel, as `torchrun --nproc_per_node=2 -m dtrain.train --profile profiles/ll128.yaml` finds it."""
    python, env, work, _ = installed
    for name, shown in (("smoke", "name: smoke"), ("ll128", "name: base-ll128")):
        r = run([str(python), "-m", "dtrain.train", "--profile", f"profiles/{name}.yaml", "--dry-run"], cwd=work,
                env=env)
        assert shown in r.stdout and "# precision here: fp32 (train.amp fp32: set in the profile; " in r.stdout
    assert "group world (default group): protocol LL128" in r.stdout  # the NCCL plan (on gloo: recorded, not applied)
    assert not (work / "profiles").exists()


def test_the_tuner_plugin_builds_from_the_installed_source(installed):
    python, env, work, _ = installed
    lib = Path(run([str(python), "-m", "dtrain", "nccl", "build-tuner"], cwd=work, env=env).stdout.strip())
    print(lib)
    assert lib.is_file() and lib.is_relative_to(Path(env["XDG_CACHE_HOME"]))  # the user cache, not the package
    assert hasattr(ctypes.CDLL(str(lib)), "ncclTunerPlugin_v6")  # what NCCL looks up in the plugin
