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
from typing import Mapping, NamedTuple, Optional, Sequence

import numpy as np

from fedjax_graph import methods as methods_lib
from fedjax_graph import report, tables
from fedjax_graph.checkpoint import fingerprint
from fedjax_graph.config import Config
from fedjax_graph.data import Federation, build_federation, load_dataset
from fedjax_graph.experiment import (check_run_args, default_out_dir, prepare_out_dir, provenance,
                                     remove_outputs)
from fedjax_graph.models import make_model
from fedjax_graph.sweep import Cells, grid_cells, make_cells, run_sweep

GRID = (0.1, 0.3, 0.5, 0.7, 0.9)
SELECTIONS = ("fixed", "val")
RUNS = "runs"
FINISHED = "table.md"


class RunResult(NamedTuple):
  """The saved arrays of one sweep (``runs/<key>.npz``); cells: G' = FedIA-family cells, then the base.

  Attributes:
    test_acc, val_acc: f32[S, G', T, D]. predicted_classes: i32[S, G', T, D].
    nonfinite: bool[S, G', T, C]. alpha: f32[S, G', T, C].
    rho, beta: f64[G']. fedia, momentum: bool[G'] (see ``simulation.Cells``).
    seconds: wall time of the sweep (s).
  """
  test_acc: np.ndarray
  val_acc: np.ndarray
  predicted_classes: np.ndarray
  nonfinite: np.ndarray
  alpha: np.ndarray
  rho: np.ndarray
  beta: np.ndarray
  fedia: np.ndarray
  momentum: np.ndarray
  seconds: float


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
  model = make_model(config.backbone, 2, config.hidden, config.num_layers, config.dropout)
  for name in names:
    methods_lib.make_method(name, model, config, defaults["hparams"].get(name, {}))
  for name in names:
    rho, beta = fedia_setting(defaults, config.dataset, config.setting, name)
    make_cells([(True, rho, beta)])  # range checks


def _run_key(out_dir: pathlib.Path, key: str) -> pathlib.Path:
  return out_dir / RUNS / f"{key}.npz"


def load_run(path: pathlib.Path) -> RunResult:
  with np.load(path) as f:
    return RunResult(**{name: f[name] for name in RunResult._fields})


def run_cells(config: Config, federation: Federation, cells: Cells, key: str, method: str,
              hparams: Mapping, rounds: int, out_dir: pathlib.Path, setup: Mapping,
              chunk: int, progress: bool, nonfinite: str, checkpoint_every: int) -> RunResult:
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
  # Cell values as the user gave them (0.9, not float32's 0.8999999761581421).
  as_given = lambda values: np.round(np.asarray(values, np.float64), 6)
  result = RunResult(history.test_acc, history.val_acc, history.predicted_classes,
                     history.nonfinite, history.alpha, as_given(cells.rho), as_given(cells.beta),
                     np.asarray(cells.fedia), np.asarray(cells.momentum),
                     time.perf_counter() - start)
  report.write_history(path, **result._asdict(), domains=np.asarray(federation.domains),
                       seeds=np.asarray(federation.seeds))
  checkpoint.unlink(missing_ok=True)
  return result


def validation_avg(result: RunResult, g: int, last: int) -> float:
  """Cell g's validation AVG (%): mean over seeds of the final-rounds mean."""
  return float(tables.final_accuracy(result.val_acc[:, g], last)[:, -1].mean())


def select_cell(result: RunResult, select: str, last: int) -> int:
  """Index of the reported "+FedIA" cell: the only one (fixed) or the best validation AVG (val)."""
  candidates = np.flatnonzero(result.fedia & result.momentum)
  if select == "fixed" or len(candidates) == 1:
    return int(candidates[0])
  val_avg = np.array([validation_avg(result, g, last) for g in candidates])
  if np.isnan(val_avg).all():  # every cell failed: report the first, shown as NC
    return int(candidates[0])
  return int(candidates[int(np.nanargmax(val_avg))])


def make_row(result: RunResult, g: int, label: str, method: str, variant: str,
             last: int) -> tables.TableRow:
  """The table row of cell ``g`` of a run (deltas filled in by ``add_deltas``)."""
  mean, std = tables.final_spread(result.test_acc[:, g], last)
  status = tables.convergence_status(result.test_acc[:, g], result.predicted_classes[:, g],
                                     int(result.nonfinite[:, g].sum()), last)
  uses_mask, uses_momentum = bool(result.fedia[g]), bool(result.momentum[g])
  return tables.TableRow(label, method, variant,
                         float(result.rho[g]) if uses_mask else None,
                         float(result.beta[g]) if uses_momentum else None,
                         mean, std, None, None, status)


def add_deltas(rows: Sequence[tables.TableRow]) -> list[tables.TableRow]:
  """Fills each row's change against its base method's row and against FedAvg's."""
  base = {r.method: r for r in rows if r.variant == "base"}
  fedavg = base.get("fedavg")
  out = []
  for row in rows:
    delta_base = None if row.variant == "base" else row.mean - base[row.method].mean
    delta_fedavg = (None if fedavg is None or row is fedavg
                    else float(row.mean[-1] - fedavg.mean[-1]))
    out.append(row._replace(delta_base=delta_base, delta_fedavg=delta_fedavg))
  return out


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
                 + [f"{RUNS}/{k}.npz" for k in keys])


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

  hparams = {m: dict(defaults["hparams"].get(m, {})) for m in method_names}
  settings = {m: fedia_setting(defaults, config.dataset, config.setting, m) for m in method_names}
  setup = {"config": config.to_dict(), "methods": list(method_names), "hparams": hparams,
           "fedia": ({m: list(v) for m, v in settings.items()} if select == "fixed" else None),
           "select": select, "seeds": [int(s) for s in seeds], "rounds": rounds, "chunk": chunk}
  record = _record(setup, federation, meta, last=last, nonfinite=nonfinite,
                   checkpoint_every=checkpoint_every, raw_dir=raw_dir and str(raw_dir),
                   cache_dir=cache_dir and str(cache_dir))
  report.write_json(out_dir / "config.json", record)

  rows, seconds, chosen, chosen_val = [], {}, {}, {}
  for name in method_names:
    cells = (grid_cells(GRID, GRID) if select == "val"
             else make_cells([(True, *settings[name]), (False, 1.0, 1.0)]))
    result = run_cells(config, federation, cells, name, name, hparams[name], rounds, out_dir,
                       setup, chunk, progress, nonfinite, checkpoint_every)
    g = select_cell(result, select, last)
    label = methods_lib.DISPLAY[name]
    rows += [make_row(result, len(result.rho) - 1, label, name, "base", last),
             make_row(result, g, f"{label}+FedIA", name, "+FedIA", last)]
    seconds[name], chosen[name] = float(result.seconds), [float(result.rho[g]),
                                                          float(result.beta[g])]
    chosen_val[name] = validation_avg(result, g, last)
  rows = add_deltas(rows)
  domains = list(federation.domains)
  title = _title(config, rounds, seeds, last) + f", (ρ, β) {select}"
  plot_table(rows, out_dir / "table.png", title)
  report.write_json(out_dir / "config.json", {**record, "status": "finished",
                                              "fedia_selected": chosen,
                                              "fedia_selected_val_avg": chosen_val,
                                              "seconds_per_method": seconds})
  tables.write_tables(rows, domains, out_dir / "table", title)
  print(tables.to_markdown(rows, domains, title))
  print(f"results in {out_dir}")
  return out_dir


def plot_table(rows: Sequence[tables.TableRow], path: pathlib.Path, title: str) -> None:
  """Bar chart of AVG (mean ± std over seeds) per method, base next to +FedIA; NC rows hatched."""
  import matplotlib
  matplotlib.use("Agg", force=False)
  from matplotlib.figure import Figure

  fig = Figure(figsize=(1.2 + 0.55 * len(rows), 3.6))
  ax = fig.add_subplot()
  colors = {"base": "#8c8c8c", "+IM": "#6baed6", "+FedIA": "#2171b5"}
  names = {"base": "base method", "+IM": "+IM (mask only)", "+FedIA": "+FedIA (IM+CAM)"}
  seen = set()
  for i, row in enumerate(rows):
    ok = tables.converged(row)
    label = names[row.variant] if row.variant not in seen else None
    seen.add(row.variant)
    ax.bar(i, row.mean[-1] if ok else 0.0, yerr=row.std[-1] if ok else None, capsize=3,
           color=colors[row.variant], hatch=None if ok else "//", label=label)
    if not ok:
      ax.text(i, 0, "NC", ha="center", va="bottom", fontsize=8)
  ax.set_xticks(range(len(rows)), [r.label for r in rows], rotation=45, ha="right", fontsize=8)
  ax.set_ylabel("AVG test accuracy (%), ± std")
  ax.set_ylim(0, 100)
  ax.legend(fontsize=7, loc="upper right")
  ax.set_title(title, fontsize=7, wrap=True)
  report.save_figure(fig, path)


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
    rows = add_deltas([make_row(result, g, label, "fedavg", variant, last)
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
  plot_table(all_rows, out_dir / "table.png", f"{configs[0].dataset} ablation")
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
