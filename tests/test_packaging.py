"""`pip install .` into a fresh environment ships every package, preset and the method config."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import setuptools

from conftest import REPO

# Run from outside the repository, by the installed package only.
PROBE = """
import json, pathlib, pkgutil
import fedjax_graph
from fedjax_graph import config
names = config.preset_names()
presets = {d: [config.load_preset(d, s).setting for s in settings] for d, settings in names.items()}
methods = config.load_yaml((config.CONFIG_DIR / "methods" / "defaults.yaml").read_text())
print(json.dumps({
    "package": fedjax_graph.__file__, "config_dir": str(config.CONFIG_DIR), "presets": presets,
    "methods": sorted(methods["hparams"]),
    "subpackages": sorted(m.name for m in pkgutil.iter_modules(fedjax_graph.__path__) if m.ispkg),
}))
"""


def _builds_wheels_offline() -> bool:
  # setuptools builds wheels itself from 70.1 on; before, it needs the wheel package.
  version = tuple(int(part) for part in setuptools.__version__.split(".")[:2])
  return version >= (70, 1) or importlib.util.find_spec("wheel") is not None


def test_installed_package_loads_every_preset(tmp_path):
  source = tmp_path / "source"  # a copy, so the build leaves nothing in the repository
  ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
  for name in ("fedjax_graph", "data_prep", "configs"):
    shutil.copytree(REPO / name, source / name, ignore=ignore)
  for name in ("pyproject.toml", "requirements.txt"):
    shutil.copy(REPO / name, source / name)
  venv = tmp_path / "venv"
  # The system's site-packages give the dependencies (--no-deps: no download).
  subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                  str(venv)], check=True, timeout=30)
  python = venv / "bin" / "python"
  # Offline where the environment can build a wheel; else pip fetches setuptools to build.
  isolation = ["--no-build-isolation"] if _builds_wheels_offline() else []
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                  "--no-deps", *isolation, str(source)], check=True, timeout=60, env=env)
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  probe = subprocess.run([str(python), "-c", PROBE], cwd=elsewhere, env=env, check=True,
                         capture_output=True, text=True, timeout=60)
  found = json.loads(probe.stdout.splitlines()[-1])

  site = venv / "lib"
  assert found["package"].startswith(str(site)) and found["config_dir"].startswith(str(site))
  assert found["presets"] == {"twitch": ["s1", "s2", "s3"], "wikinet": ["default"]}
  assert {"fedavg", "fedprox", "scaffold"} <= set(found["methods"])
  in_source = sorted(p.parent.name for p in (REPO / "fedjax_graph").glob("*/__init__.py"))
  assert found["subpackages"] == in_source  # none left out of pyproject.toml's packages
