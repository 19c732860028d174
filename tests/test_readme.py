"""The README's FedIA example runs as written and does what its comments say."""

import re

import jax.numpy as jnp
import numpy as np

from conftest import REPO, script_main


def test_readme_fedia_example_runs():
  text = (REPO / "README.md").read_text()
  blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "aggregators.fedia()" in b]
  assert len(blocks) == 1
  namespace = {}
  exec(compile(blocks[0], "README.md", "exec"), namespace)
  alpha = np.asarray(namespace["diag"].alpha)
  assert alpha.shape == (4,) and np.isclose(alpha.sum(), 1.0)
  kernel = namespace["updates"]["params"]["kernel"]
  assert kernel.shape == (3, 8, 3)  # one aggregate per rho of the grid
  kept = np.asarray(jnp.mean(kernel != 0, axis=(1, 2)))
  np.testing.assert_allclose(kept, [2 / 24, 12 / 24, 22 / 24], atol=1e-6)  # round(rho * 24) / 24


def test_readme_first_check_runs_and_writes_the_files_it_names(raw_dir, prepared_cache, tmp_path):
  text = (REPO / "README.md").read_text()
  section = text.split("## A first check", 1)[1].split("\n## ", 1)[0]
  command = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ").split()
  assert command[:2] == ["python", "experiments/grid.py"]
  argv = command[2:]
  argv[argv.index("--raw-dir") + 1] = str(raw_dir)
  argv[argv.index("--out") + 1] = str(tmp_path / "first-check")
  # The flags as written, then fewer rounds and a narrower model: this test's cost is the compile.
  script_main("grid")(argv + ["--cache-dir", str(prepared_cache), "--no-progress", "--rounds", "2",
                              "--set", "hidden=16", "--set", "local_steps=2"])
  named = re.findall(r"`(\w+\.\w+)`", section)
  assert named == ["summary.csv", "history.npz", "curves.png", "heatmap.png", "config.json"]
  assert all((tmp_path / "first-check" / name).is_file() for name in named)
