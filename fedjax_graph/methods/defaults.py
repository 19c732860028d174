"""The method config: each method's hyper-parameters, FedIA's (rho, beta) and the other aggregators'.

``configs/methods/defaults.yaml`` holds each method's defaults from its own
paper, the paper's Table 7 (rho, beta) and the hyper-parameters of the other
aggregators a table can put next to a method (GMA, FedHEAL);
``table.py --method-config FILE`` reads a file of the same shape whose
entries replace the shipped file's, key by key.
"""

import pathlib

import yaml

from fedjax_graph.config import CONFIG_DIR, load_yaml

METHODS_FILE = CONFIG_DIR / "methods" / "defaults.yaml"


def _read(path: pathlib.Path):
  try:
    with open(path) as f:
      return load_yaml(f)
  except yaml.YAMLError as err:
    raise ValueError(f"{path}: not valid YAML ({err})")
  except (FileNotFoundError, IsADirectoryError) as err:  # a typo in the path, not an I/O fault
    raise ValueError(f"method config {path}: {err.strerror}")


def _merged(shipped, given):
  """``given`` over ``shipped``: mappings merged key by key, anything else (a value, a pair) replaced."""
  if not isinstance(shipped, dict) or not isinstance(given, dict):
    return given
  return {**shipped, **{key: _merged(shipped.get(key), value) for key, value in given.items()}}


def method_defaults(path: pathlib.Path = METHODS_FILE) -> dict:
  """Reads and checks a method config over the shipped one (``configs/methods/defaults.yaml``).

  The file maps ``hparams`` to ``{method: {name: value}}`` (methods left out
  take the functions' defaults), ``fedia`` to ``{default: [rho, beta],
  <dataset>: {<setting>: {method: [rho, beta]}}}`` and ``aggregators`` to
  ``{aggregator: {name: value}}`` (e.g. ``gma: {tau: 0.1}``; left out: the
  aggregator's defaults). Floats are read as YAML 1.2 does (``1e-5`` is a
  number). A file other than the shipped one replaces the shipped values
  key by key: ``hparams: {fgssl: {loss: code}}`` changes FGSSL's loss and
  keeps every other value, the paper's Table 7 (rho, beta) included.

  Raises:
    ValueError: naming the file and the key of the first bad entry, or a
      path that is missing or a folder.
    OSError: if the file cannot be read otherwise (e.g. permissions).
  """
  raw = _read(path)
  if pathlib.Path(path).resolve() != METHODS_FILE.resolve():
    if not isinstance(raw, dict) or not raw:  # checked as the user wrote it, not merged
      return check_method_config(raw, str(path))
    raw = _merged(_read(METHODS_FILE), raw)
  return check_method_config(raw, str(path))


def _pair(value, where: str) -> tuple[float, float]:
  ok = (isinstance(value, (list, tuple)) and len(value) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value))
  if not ok:
    raise ValueError(f"{where} = {value!r}; must be [rho, beta], two numbers")
  rho, beta = float(value[0]), float(value[1])
  if not 0 < rho <= 1:
    raise ValueError(f"{where}: rho = {rho:g}; the mask ratio must be in (0, 1]")
  if not 0 <= beta <= 1:
    raise ValueError(f"{where}: beta = {beta:g}; the momentum must be in [0, 1]")
  return rho, beta


def check_method_config(raw, source: str = "method config") -> dict:
  """Checks a method config's structure (see ``method_defaults``); returns it, defaults filled.

  The result also holds ``source``, the name later errors about its values
  give (``comparison.check_methods`` checks each method's hyper-parameters
  against its factory).

  Raises:
    ValueError: naming ``source`` and the key of the first bad entry.
  """
  def mapping(value, where):
    if value is None:
      return {}
    if not isinstance(value, dict):
      raise ValueError(f"{source}: {where} must be a mapping, got {value!r}")
    return value

  from data_prep.registry import DATASETS
  from fedjax_graph import cells as cells_lib
  from fedjax_graph.methods import METHODS  # the registry imports this module

  if not isinstance(raw, dict) or not raw:
    raise ValueError(f"{source}: must be a mapping with the keys 'hparams', 'fedia' and "
                     "'aggregators'")
  unknown = sorted(set(raw) - {"hparams", "fedia", "aggregators"})
  if unknown:
    raise ValueError(f"{source}: unknown key(s) {unknown}; valid: ['aggregators', 'fedia', "
                     "'hparams']")
  hparams = mapping(raw.get("hparams"), "hparams")
  for name, values in hparams.items():
    if name not in METHODS:
      raise ValueError(f"{source}: hparams.{name}: unknown method; choose from "
                       f"{', '.join(METHODS)}")
    hparams[name] = mapping(values, f"hparams.{name}")
  fedia = mapping(raw.get("fedia"), "fedia")
  fedia["default"] = _pair(fedia.get("default", [0.5, 0.5]), f"{source}: fedia.default")
  for dataset, settings in fedia.items():
    if dataset == "default":
      continue
    if dataset not in DATASETS:
      raise ValueError(f"{source}: fedia.{dataset}: unknown dataset; choose from "
                       f"{', '.join(sorted(DATASETS))} (or 'default')")
    for setting, table in mapping(settings, f"fedia.{dataset}").items():
      for name, pair in mapping(table, f"fedia.{dataset}.{setting}").items():
        where = f"{source}: fedia.{dataset}.{setting}.{name}"
        if name not in METHODS:
          raise ValueError(f"{where}: unknown method; choose from {', '.join(METHODS)}")
        _pair(pair, where)
  others = mapping(raw.get("aggregators"), "aggregators")
  for name, values in others.items():
    where = f"{source}: aggregators.{name}"
    try:  # unknown names and out-of-range values, in the aggregators' own words
      cells_lib.cell(name, **mapping(values, f"aggregators.{name}"))
    except (ValueError, TypeError) as err:
      raise ValueError(f"{where}: {err}")
  return {"hparams": hparams, "fedia": fedia, "aggregators": others, "source": source}
