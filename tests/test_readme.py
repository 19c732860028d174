"""The README's FedIA example runs as written and does what its comments say."""

import re

import jax.numpy as jnp
import numpy as np

from conftest import REPO


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
