"""Base methods alone and "+FedIA" (FedIA paper, Tables 2-5), and the IM/CAM ablation (Table 6).

For each base method, ONE compiled program runs every seed and cell: the
method's own aggregation and its "+FedIA" cell (or, with ``select="val"``, the
5 x 5 (rho, beta) grid, from which the cell with the best validation AVG is
reported: the honest protocol, which the paper does not use). Each finished
method is saved to ``runs/<method>.npz`` at once and the running one is
checkpointed, so an interrupted table continues where it stopped
(``resume_table``). ``experiments/table.py`` and ``experiments/ablation.py``
are the command lines.
"""

import json
import pathlib
import time
from typing import Mapping, Optional, Sequence

import numpy as np

from fedjax_graph import methods as methods_lib
from fedjax_graph import references, report, tables
from fedjax_graph.checkpoint import fingerprint
from fedjax_graph.config import Config
from fedjax_graph.data import Federation, build_federation, load_dataset
from fedjax_graph.experiment import (check_run_args, default_out_dir, prepare_out_dir, provenance,
                                     remove_outputs)
from fedjax_graph.sweep import Cells, grid_cells, make_cells, run_sweep

GRID = (0.1, 0.3, 0.5, 0.7, 0.9)
SELECTIONS = ("fixed", "val")
RUNS = "runs"
FINISHED = "table.md"


def fedia_setting(defaults: Mapping, dataset: str, setting: str, method: str) -> tuple:
  """(rho, beta) of "<method>+FedIA" from ``configs/methods/defaults.yaml``."""
  per_setting = defaults["fedia"].get(dataset, {}).get(setting, {})
  rho, beta = per_setting.get(method, defaults["fedia"]["default"])
  return float(rho), float(beta)


def check_methods(names: Sequence[str], config: Config, defaults: Mapping) -> None:
  """Checks the method list and every method's hyper-parameters before anything runs.

  Raises:
    ValueError: naming an unknown, repeated or badly configured method.
  """
  if not names or len(set(names)) != len(names):
    raise ValueError(f"methods = {list(names)}; give at least one, without repeats")
  unknown = [n for n in names if n not in methods_lib.METHODS and n not in references.REFERENCES]
  if unknown:
    raise ValueError(f"unknown method {unknown[0]!r}; choose from "
                     f"{', '.join(list(methods_lib.METHODS) + list(references.REFERENCES))}")
  model = config.model(2)
  for name in base_methods(names):
    methods_lib.make_method(name, model, config, defaults["hparams"].get(name, {}))
    rho, beta = fedia_setting(defaults, config.dataset, config.setting, name)
    make_cells([(True, rho, beta)])  # range checks


def base_methods(names: Sequence[str]) -> list[str]:
  """The federated methods among ``names`` (the references left out)."""
  return [n for n in names if n not in references.REFERENCES]


def _run_key(out_dir: pathlib.Path, key: str) -> pathlib.Path:
  return out_dir / RUNS / f"{key}.npz"


def load_run(path: pathlib.Path) -> tables.RunResult:
  with np.load(path) as f:
    return tables.RunResult(**{name: f[name] for name in tables.RunResult._fields})


def run_cells(config: Config, federation: Federation, cells: Cells, key: str, method: str,
              hparams: Mapping, rounds: int, out_dir: pathlib.Path, setup: Mapping,
              chunk: int, progress: bool, nonfinite: str, checkpoint_every: int) -> tables.RunResult:
  """Runs one method over ``cells`` for all seeds (or loads its finished run) and saves it.

  The sweep checkpoints to ``checkpoint-<key>.msgpack`` and resumes from it.
  """
  path = _run_key(out_dir, key)
  if path.exists():
    return load_run(path)
  checkpoint = out_dir / f"checkpoint-{key}.msgpack"
  start = time.perf_counter()
  history = run_sweep(config, federation, cells, rounds, chunk=chunk, progress=progress,
                      description=key, nonfinite=nonfinite, checkpoint_path=checkpoint,
                      checkpoint_every=checkpoint_every, method=method,
                      method_hparams=dict(hparams),
                      fingerprint=fingerprint({**setup, "run": key}))
  result = _save_run(path, history._asdict(), cells, federation, time.perf_counter() - start)
  checkpoint.unlink(missing_ok=True)
  return result


def _save_run(path: pathlib.Path, arrays: Mapping, cells: Cells, federation: Federation,
              seconds: float) -> tables.RunResult:
  # Cell values as the user gave them (0.9, not float32's 0.8999999761581421).
  as_given = lambda values: np.round(np.asarray(values, np.float64), 6)
  recorded = {name: arrays[name] for name in tables.RunResult._fields
              if name in arrays and name != "seconds"}
  result = tables.RunResult(**recorded, rho=as_given(cells.rho), beta=as_given(cells.beta),
                            fedia=np.asarray(cells.fedia), momentum=np.asarray(cells.momentum),
                            seconds=seconds)
  report.write_history(path, **result._asdict(), domains=np.asarray(federation.domains),
                       seeds=np.asarray(federation.seeds))
  return result


def run_reference(name: str, config: Config, federation: Federation, domain_graphs,
                  rounds: int, out_dir: pathlib.Path, setup: Mapping, chunk: int,
                  progress: bool, nonfinite: str, checkpoint_every: int) -> tables.RunResult:
  """A reference row's run (``references``) on the same seeds and splits, saved like a method's."""
  base_cell = make_cells([(False, 1.0, 1.0)])
  if name == "majority":
    path = _run_key(out_dir, name)
    if path.exists():
      return load_run(path)
    start = time.perf_counter()
    return _save_run(path, references.majority_history(federation, rounds), base_cell,
                     federation, time.perf_counter() - start)
  if name == "centralized":
    federation, method = build_federation(config, domain_graphs, federation.seeds,
                                          pooled=True), "fedavg"
  else:
    method = "local"
  return run_cells(config, federation, base_cell, name, method, {}, rounds, out_dir, setup,
                   chunk, progress, nonfinite, checkpoint_every)


def _checked(defaults: Optional[Mapping]) -> dict:
  if defaults is None:
    return methods_lib.method_defaults()
  return methods_lib.check_method_config(dict(defaults))


def _remove_previous(out_dir: pathlib.Path, keys: Sequence[str]) -> None:
  """On --overwrite: deletes this tool's files of the previous run and of the new keys, nothing else."""
  try:
    old = json.loads((out_dir / "config.json").read_text())
    keys = list(keys) + list(old.get("methods") or []) + list(old.get("ablation") or {})
  except (OSError, ValueError):
    pass
  remove_outputs(out_dir, [f"table.{ext}" for ext in ("md", "csv", "tex", "png")]
                 + ["config.json"] + [f"checkpoint-{k}.msgpack" for k in keys]
                 + [f"{RUNS}/{k}.npz" for k in keys] + [f"heatmap-{k}.png" for k in keys])


def _title(config: Config, rounds: int, seeds: Sequence[int], last: int) -> str:
  spread = "± std over seeds" if len(seeds) > 1 else f"± std over the last {last} rounds"
  participation = (f", {config.participation:g} of clients per round"
                   if config.participation < 1 else "")
  return (f"{config.dataset} {config.setting}, {config.backbone}, {rounds} rounds, seeds "
          f"{list(seeds)}, mean of the last {last} rounds {spread}{participation}")


def _record(setup: Mapping, federation: Federation, meta: Mapping, **extra) -> dict:
  return {**setup, **extra, "status": "running", "num_clients": federation.num_clients,
          "data": {"source_sha256": meta.get("source_sha256"),
                   "format_version": meta.get("format_version")}, **provenance()}


def run_table(config: Config, method_names: Sequence[str], seeds: Sequence[int], rounds: int,
              last: int, select: str = "fixed", out_dir: Optional[pathlib.Path] = None,
              defaults: Optional[Mapping] = None, raw_dir=None, cache_dir=None, chunk: int = 10,
              progress: bool = True, domain_graphs=None, nonfinite: str = "error",
              checkpoint_every: int = 1, resume: bool = False, overwrite: bool = False,
              verify: bool = True) -> pathlib.Path:
  """Runs every base method alone and "+FedIA" and writes the comparison tables.

  Writes into ``out_dir``: ``table.md``, ``table.csv``, ``table.tex`` (per
  domain mean±std over seeds of the final ``last`` rounds, AVG, the change
  against the base method and against FedAvg), ``table.png``, ``config.json``
  and ``runs/<method>.npz`` (every cell's history).

  Args:
    config: the federation preset and local training recipe.
    method_names: base methods (keys of ``methods.METHODS``), in table order.
    seeds, rounds, last: as for ``experiment.run_grid``.
    select: ``fixed``: "+FedIA" at the (rho, beta) of ``defaults``; ``val``:
      at the grid cell with the best validation AVG (all 25 in one sweep).
    defaults: ``methods.method_defaults()`` or an equivalent mapping.
    Other arguments: as for ``experiment.run_grid``.

  Raises:
    ValueError: for a bad method, hyper-parameter, selection, seed list,
      rounds or last, or an output folder that holds a run.
  """
  check_run_args(rounds, last, seeds, chunk, checkpoint_every, nonfinite)
  if select not in SELECTIONS:
    raise ValueError(f"select = {select!r}; choose one of {SELECTIONS}")
  defaults = _checked(defaults)
  check_methods(method_names, config, defaults)
  out_dir = pathlib.Path(out_dir) if out_dir else default_out_dir(config, "table")
  prepare_out_dir(out_dir, resume, overwrite, finished_marker=FINISHED)
  meta = {}
  if domain_graphs is None:
    domain_graphs, meta = load_dataset(config.dataset, raw_dir, cache_dir, verify)
  federation = build_federation(config, domain_graphs, seeds)
  if overwrite:
    _remove_previous(out_dir, method_names)
  out_dir.mkdir(parents=True, exist_ok=True)

  hparams = {m: dict(defaults["hparams"].get(m, {})) for m in base_methods(method_names)}
  settings = {m: fedia_setting(defaults, config.dataset, config.setting, m)
              for m in base_methods(method_names)}
  setup = {"config": config.to_dict(), "methods": list(method_names), "hparams": hparams,
           "fedia": ({m: list(v) for m, v in settings.items()} if select == "fixed" else None),
           "select": select, "seeds": [int(s) for s in seeds], "rounds": rounds, "chunk": chunk}
  record = _record(setup, federation, meta, last=last, nonfinite=nonfinite,
                   checkpoint_every=checkpoint_every, raw_dir=raw_dir and str(raw_dir),
                   cache_dir=cache_dir and str(cache_dir))
  report.write_json(out_dir / "config.json", record)

  rows, seconds, chosen, chosen_val = [], {}, {}, {}
  for name in method_names:
    if name in references.REFERENCES:
      result = run_reference(name, config, federation, domain_graphs, rounds, out_dir, setup,
                             chunk, progress, nonfinite, checkpoint_every)
      rows.append(tables.make_row(result, 0, references.DISPLAY[name], name, "reference", last))
      seconds[name] = float(result.seconds)
      continue
    cells = (grid_cells(GRID, GRID) if select == "val"
             else make_cells([(True, *settings[name]), (False, 1.0, 1.0)]))
    result = run_cells(config, federation, cells, name, name, hparams[name], rounds, out_dir,
                       setup, chunk, progress, nonfinite, checkpoint_every)
    g = tables.select_cell(result, select, last)
    label = methods_lib.DISPLAY[name]
    rows += [tables.make_row(result, len(result.rho) - 1, label, name, "base", last),
             tables.make_row(result, g, f"{label}+FedIA", name, "+FedIA", last)]
    seconds[name], chosen[name] = float(result.seconds), [float(result.rho[g]),
                                                          float(result.beta[g])]
    chosen_val[name] = tables.validation_avg(result, g, last)
    if select == "val":
      tables.plot_grid_heatmap(result, federation.domains, last, out_dir / f"heatmap-{name}.png",
                               _title(config, rounds, seeds, last), label)
  rows = tables.add_deltas(rows)
  domains = list(federation.domains)
  title = _title(config, rounds, seeds, last) + f", (ρ, β) {select}"
  tables.plot_table(rows, out_dir / "table.png", title)
  report.write_json(out_dir / "config.json", {**record, "status": "finished",
                                              "fedia_selected": chosen,
                                              "fedia_selected_val_avg": chosen_val,
                                              "seconds_per_method": seconds})
  tables.write_tables(rows, domains, out_dir / "table", title)
  print(tables.to_markdown(rows, domains, title))
  print(f"results in {out_dir}")
  return out_dir


def resume_table(out_dir: pathlib.Path, raw_dir=None, cache_dir=None, progress: bool = True,
                 domain_graphs=None, verify: bool = True,
                 nonfinite: Optional[str] = None) -> pathlib.Path:
  """Continues the unfinished table in ``out_dir``: finished methods are loaded, the running one resumes.

  Raises:
    ValueError: if ``out_dir`` holds no unfinished table run.
  """
  out_dir = pathlib.Path(out_dir)
  record = _read_record(out_dir, "methods")
  defaults = {"hparams": record["hparams"],
              "fedia": {"default": [0.5, 0.5],
                        record["config"]["dataset"]: {record["config"]["setting"]:
                                                      record["fedia"]}}}
  return run_table(Config(**record["config"]), record["methods"], record["seeds"],
                   record["rounds"], record["last"], record["select"], out_dir, defaults,
                   raw_dir or record.get("raw_dir"), cache_dir or record.get("cache_dir"),
                   record["chunk"], progress, domain_graphs, nonfinite or record["nonfinite"],
                   record.get("checkpoint_every", 1), resume=True, verify=verify)


def _read_record(out_dir: pathlib.Path, required: str) -> dict:
  try:
    record = json.loads((out_dir / "config.json").read_text())
  except FileNotFoundError:
    raise ValueError(f"{out_dir} holds no config.json: no run to resume")
  if required not in record:
    raise ValueError(f"{out_dir} holds another kind of run (its config.json has no {required!r})")
  return record


ABLATION = (("FedAvg", "base"), ("FedAvg+IM", "+IM"), ("FedAvg+IM+CAM", "+FedIA"))


def run_ablation(configs: Sequence[Config], seeds: Sequence[int], rounds: int, last: int,
                 out_dir: Optional[pathlib.Path] = None, defaults: Optional[Mapping] = None,
                 raw_dir=None, cache_dir=None, chunk: int = 10, progress: bool = True,
                 domain_graphs=None, nonfinite: str = "error", checkpoint_every: int = 1,
                 resume: bool = False, overwrite: bool = False,
                 verify: bool = True) -> pathlib.Path:
  """FedAvg, FedAvg+IM and FedAvg+IM+CAM (= FedIA) per setting (FedIA paper, Table 6).

  One compiled sweep per setting runs the three cells for all seeds, with
  FedAvg's (rho, beta) from ``defaults``. Non-convergence (NaN accuracy or a
  constant prediction through the final rounds) is reported as NC, not as a
  number. Writes ``table.md``/``.csv``/``.tex`` (all settings, one block
  each), ``table.png``, ``config.json`` and ``runs/<setting>.npz``.

  Args:
    configs: one preset per setting, all of one dataset (e.g. Twitch s1, s3).
    Other arguments: as for ``run_table``.
  """
  check_run_args(rounds, last, seeds, chunk, checkpoint_every, nonfinite)
  if not configs or len({c.dataset for c in configs}) != 1:
    raise ValueError("give at least one setting, all of one dataset")
  defaults = _checked(defaults)
  for config in configs:
    check_methods(["fedavg"], config, defaults)
  settings = {c.setting: fedia_setting(defaults, c.dataset, c.setting, "fedavg") for c in configs}
  out_dir = pathlib.Path(out_dir) if out_dir else default_out_dir(configs[0], "ablation")
  prepare_out_dir(out_dir, resume, overwrite, finished_marker=FINISHED)
  meta = {}
  if domain_graphs is None:
    domain_graphs, meta = load_dataset(configs[0].dataset, raw_dir, cache_dir, verify)
  federations = {c.setting: build_federation(c, domain_graphs, seeds) for c in configs}
  if overwrite:
    _remove_previous(out_dir, list(settings))
  out_dir.mkdir(parents=True, exist_ok=True)
  hparams = dict(defaults["hparams"].get("fedavg", {}))
  setup = {"configs": [c.to_dict() for c in configs], "ablation": settings, "hparams": hparams,
           "seeds": [int(s) for s in seeds], "rounds": rounds, "chunk": chunk}
  record = _record(setup, federations[configs[0].setting], meta, last=last, nonfinite=nonfinite,
                   checkpoint_every=checkpoint_every, raw_dir=raw_dir and str(raw_dir),
                   cache_dir=cache_dir and str(cache_dir))
  report.write_json(out_dir / "config.json", record)

  markdown, csv_text, latex, all_rows = [], [], [], []
  for config in configs:
    rho, beta = settings[config.setting]
    cells = make_cells([(True, rho, beta, False), (True, rho, beta, True), (False, 1.0, 1.0)])
    result = run_cells(config, federations[config.setting], cells, config.setting, "fedavg",
                       hparams, rounds, out_dir, setup, chunk, progress, nonfinite,
                       checkpoint_every)
    order = (2, 0, 1)  # FedAvg, +IM, +IM+CAM
    rows = tables.add_deltas([tables.make_row(result, g, label, "fedavg", variant, last)
                              for g, (label, variant) in zip(order, ABLATION)])
    domains = list(federations[config.setting].domains)
    title = _title(config, rounds, seeds, last) + f", ρ={rho:g}, β={beta:g}"
    markdown.append(tables.to_markdown(rows, domains, title))
    csv_text.append(tables.to_csv([r._replace(label=f"{config.setting}:{r.label}") for r in rows],
                                  domains))
    latex.append(tables.to_latex(rows, domains, title))
    all_rows += [r._replace(label=f"{config.setting} {r.label}") for r in rows]
  report.write_text(out_dir / "table.csv", "".join(
      text if i == 0 else text.split("\n", 1)[1] for i, text in enumerate(csv_text)))
  report.write_text(out_dir / "table.tex", "\n".join(latex))
  tables.plot_table(all_rows, out_dir / "table.png", f"{configs[0].dataset} ablation")
  report.write_json(out_dir / "config.json", {**record, "status": "finished"})
  report.write_text(out_dir / FINISHED, "\n".join(markdown))
  print("\n".join(markdown))
  print(f"results in {out_dir}")
  return out_dir


def resume_ablation(out_dir: pathlib.Path, raw_dir=None, cache_dir=None, progress: bool = True,
                    domain_graphs=None, verify: bool = True,
                    nonfinite: Optional[str] = None) -> pathlib.Path:
  """Continues the unfinished ablation in ``out_dir`` with its own config.json."""
  out_dir = pathlib.Path(out_dir)
  record = _read_record(out_dir, "ablation")
  configs = [Config(**c) for c in record["configs"]]
  defaults = {"hparams": {"fedavg": record["hparams"]}, "fedia": {
      "default": [0.5, 0.5],
      configs[0].dataset: {s: {"fedavg": v} for s, v in record["ablation"].items()}}}
  return run_ablation(configs, record["seeds"], record["rounds"], record["last"], out_dir,
                      defaults, raw_dir or record.get("raw_dir"),
                      cache_dir or record.get("cache_dir"), record["chunk"], progress,
                      domain_graphs, nonfinite or record["nonfinite"],
                      record.get("checkpoint_every", 1), resume=True, verify=verify)
