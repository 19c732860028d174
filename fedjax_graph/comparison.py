"""Methods alone and with other aggregators (FedIA paper, Tables 2-5), and the IM/CAM ablation (Table 6).

For each method, ONE compiled program runs every seed and cell: the method's
own aggregation (its ``base`` row) and a cell per aggregator asked for
(``+FedIA``, ``+GMA``, ``+FedHEAL``...; or, with ``select="val"``, each
aggregator's whole grid, from which the cell with the best validation AVG is
reported: the honest protocol, which the paper does not use). Reference rows
(``references``) run on the same seeds. Each finished method is saved to
``runs/<method>.npz`` at once and the running one is checkpointed, so an
interrupted table continues where it stopped (``resume_table``).
``experiments/table.py`` and ``experiments/ablation.py`` are the command lines.
"""

import json
import pathlib
import time
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from fedjax_graph import aggregators as aggregators_lib
from fedjax_graph import cells as cells_lib
from fedjax_graph import methods as methods_lib
from fedjax_graph import references, report, tables
from fedjax_graph.checkpoint import fingerprint
from fedjax_graph.config import Config
from fedjax_graph.controls import RunControls
from fedjax_graph.data import Federation, build_federation, load_dataset
from fedjax_graph.io import remove_file
from fedjax_graph.rundir import (check_run_args, claimed, default_out_dir, earlier_plans,
                                 marks_stopped, prepare_out_dir, provenance, read_record,
                                 record_plan, remove_outputs, resumed)
from fedjax_graph.sweep import run_sweep

GRID = (0.1, 0.3, 0.5, 0.7, 0.9)  # the paper's search space of each hyper-parameter
SELECTIONS = ("fixed", "val")
# What a table may put next to a method's own rule: every registered aggregator but the
# plain mean (a method's own averaging already is one).
AGGREGATORS = tuple(name for name in aggregators_lib.REGISTRY if name != "fedavg")
RUNS = "runs"
FINISHED = "table.md"
PARTIAL = "partial"  # finished_rows' tables, beside an unfinished run


def aggregator_setting(defaults: Mapping, dataset: str, setting: str, method: str,
                       aggregator: str) -> dict[str, float]:
  """Hyper-parameters of "<method>+<aggregator>" from the method config.

  FedIA: (rho, beta) of ``fedia.<dataset>.<setting>.<method>`` (the paper's
  Table 7 for Twitch) or ``fedia.default``; another aggregator: its entry in
  the config's ``aggregators`` (e.g. ``gma: {tau: 0.1}``), else its defaults.
  """
  if aggregator == "fedia":
    per_setting = defaults["fedia"].get(dataset, {}).get(setting, {})
    rho, beta = per_setting.get(method, defaults["fedia"]["default"])
    return {"rho": float(rho), "beta": float(beta)}
  return {name: float(value) for name, value in
          {**aggregators_lib.get(aggregator).hparams,
           **defaults.get("aggregators", {}).get(aggregator, {})}.items()}


def unmatched_setting_note(defaults: Mapping, dataset: str, setting: str) -> Optional[str]:
  """A line for a method config whose ``fedia.<dataset>`` lists settings but not this one.

  A misspelt setting key (``defualt``, ``S1``) would otherwise leave every
  "+FedIA" row on ``fedia.default`` unnoticed. Not an error: a ``--config``
  file may name a setting of its own, which the table may lack on purpose.
  """
  listed = defaults["fedia"].get(dataset) or {}
  if not listed or setting in listed:
    return None
  rho, beta = defaults["fedia"]["default"]
  return (f"{defaults.get('source', 'method config')}: fedia.{dataset} has no entry for "
          f"setting {setting!r} (it lists {', '.join(map(str, sorted(listed)))}), so FedIA runs "
          f"with fedia.default (rho={rho:g}, beta={beta:g})")


def base_methods(names: Sequence[str]) -> list[str]:
  """The federated methods among ``names`` (the references left out)."""
  return [n for n in names if n not in references.REFERENCES]


def check_methods(names: Sequence[str], aggregators: Sequence[str], config: Config,
                  defaults: Mapping) -> None:
  """Checks the method and aggregator lists and every hyper-parameter before anything runs.

  Raises:
    ValueError: naming an unknown, repeated or badly configured method or aggregator,
      or a method with per-tensor client weights (``Method.leaf_weights``:
      FedSPA's HBDA) next to an aggregator that cannot take them (GMA, FedHEAL).
  """
  if not names or len(set(names)) != len(names):
    raise ValueError(f"methods = {list(names)}; give at least one, without repeats")
  unknown = [n for n in names if n not in methods_lib.METHODS and n not in references.REFERENCES]
  if unknown:
    raise ValueError(f"unknown method {unknown[0]!r}; choose from "
                     f"{', '.join(list(methods_lib.METHODS) + list(references.REFERENCES))}")
  if len(set(aggregators)) != len(aggregators) or any(a not in AGGREGATORS for a in aggregators):
    raise ValueError(f"aggregators = {list(aggregators)}; choose from {', '.join(AGGREGATORS)}, "
                     "without repeats")
  for name in defaults["hparams"]:  # the methods configured but not run, too: a typo shows now
    if name not in names:
      configured_method(name, config, defaults)
  for name in base_methods(names):
    method = configured_method(name, config, defaults)
    for aggregator in aggregators:
      if method.leaf_weights is not None and not aggregators_lib.get(aggregator).per_leaf:
        raise ValueError(f"{name} weighs each parameter tensor by its own client weights "
                         f"(Method.leaf_weights), which {aggregator} does not take; use "
                         "fedia, or run it without the leaf weights (fedspa_nohbda)")
      cells_lib.cell(aggregator, **aggregator_setting(defaults, config.dataset, config.setting,
                                                      name, aggregator))  # range checks


def row_label(method: str, aggregator: Optional[str] = None) -> str:
  """A table row's name: the method's display name, alone or ``<method>+<aggregator>``.

  ``methods.ROW_DISPLAY`` names a pair otherwise (``fedspa_nohbda`` with
  ``fedia``: "FedIA (repl.)").
  """
  display = methods_lib.DISPLAY[method]
  if aggregator is None:
    return display
  return methods_lib.ROW_DISPLAY.get(
      (method, aggregator), f"{display}+{aggregators_lib.DISPLAY[aggregator]}")


def configured_method(name: str, config: Config, defaults: Mapping) -> methods_lib.Method:
  """Method ``name`` with its hyper-parameters from the method config ``defaults``.

  Raises:
    ValueError: for a bad hyper-parameter, naming the config's source (its
      file), ``hparams.<method>``, the value and what is allowed.
  """
  try:
    return methods_lib.make_method(name, config.model(2), config,
                                   defaults["hparams"].get(name, {}))
  except ValueError as err:  # "<method>: <what is wrong>"
    raise ValueError(f"{defaults.get('source', 'method config')}: hparams.{err}") from None


def _recipes(names: Sequence[str], config: Config, defaults: Mapping) -> dict[str, Mapping]:
  """``{method: Method.recipe}`` of the base methods among ``names`` that fix config fields."""
  out = {}
  for name in base_methods(names):
    recipe = configured_method(name, config, defaults).recipe
    if recipe:
      out[name] = recipe
  return out


def own_backbones(names: Sequence[str], config: Config, defaults: Mapping) -> dict[str, str]:
  """``{method: backbone}`` of the methods among ``names`` on a backbone not the config's.

  Read from ``Method.recipe`` (FedSPA: ``sfpd``).
  """
  return {name: recipe["backbone"] for name, recipe in _recipes(names, config, defaults).items()
          if recipe.get("backbone", config.backbone) != config.backbone}


def recipe_overrides(names: Sequence[str], config: Config, defaults: Mapping,
                     given: Mapping[str, Any]) -> list[str]:
  """One line per config field in ``given`` (the user's flags) that a method's recipe replaces.

  FedSPA trains its own SFPD backbone (``hidden``, ``num_layers``, ``dropout``, ``norm``
  from its hyper-parameters), so ``--set hidden=64`` does not reach its rows; the line
  says so and where the method's value is set.
  """
  out = []
  for name, recipe in _recipes(names, config, defaults).items():
    for key in sorted(set(recipe) & set(given)):
      if recipe[key] != given[key]:
        where = (f"hparams.{name}.{key} in --method-config"
                 if key in methods_lib.hparams_in_effect(name) else "the method's recipe")
        out.append(f"{name} runs with {key}={recipe[key]!r}, not the {key}={given[key]!r} "
                   f"given (set it by {where})")
  return out


def _rows_by_backbone(methods: Sequence[str], aggregators: Sequence[str], config: Config,
                      defaults: Mapping) -> dict[str, list[str]]:
  """``{backbone: row labels}`` of the rows not on the config's backbone (for the title)."""
  own = {}
  for name, backbone in own_backbones(methods, config, defaults).items():
    own.setdefault(backbone, []).extend(
        [row_label(name)] + [row_label(name, a) for a in aggregators])
  return own


def method_cells(method: str, aggregators: Sequence[str], settings: Mapping[str, Mapping],
                 select: str) -> cells_lib.Cells:
  """A method's cells: one per aggregator (``fixed``) or each aggregator's grid (``val``), then its own."""
  display = row_label(method)
  out = []
  for aggregator in aggregators:
    row = row_label(method, aggregator)
    if select == "fixed":
      out.append(cells_lib.cell(aggregator, label=row, **settings[aggregator]))
    else:
      grid = cells_lib.grid(aggregator, **{n: GRID for n in aggregators_lib.get(aggregator).hparams})
      out += [c._replace(label=f"{row} {c.label.split(' ', 1)[1]}") for c in grid.cells[:-1]]
  return cells_lib.Cells(out + [cells_lib.cell(cells_lib.BASE, label=display)])


def _run_path(out_dir: pathlib.Path, key: str) -> pathlib.Path:
  return out_dir / RUNS / f"{key}.npz"


def run_setup(config: Config, cells: cells_lib.Cells, method: str, hparams: Mapping,
              seeds: Sequence[int], rounds: int) -> dict:
  """What a saved run's numbers depend on: kept in its npz (``save_run``), checked on loading.

  The preset and recipe, the method and its hyper-parameters, the cells
  (labels and aggregator hyper-parameters), seeds and rounds, as JSON values.
  """
  cell_hparams = {n: [None if np.isnan(v) else round(float(v), 6) for v in values]
                  for n, values in cells.hparam_table().items()}
  setup = {"config": config.to_dict(), "method": method, "hparams": dict(hparams),
           "cells": list(cells.labels), "cell_hparams": cell_hparams,
           "seeds": [int(s) for s in seeds], "rounds": int(rounds)}
  return json.loads(json.dumps(setup, sort_keys=True))  # tuples as lists, as a file holds them


def _differences(saved: Mapping, expected: Mapping) -> list[str]:
  """``key: <saved> in the file, <expected> here`` per differing key (one level into mappings)."""
  out = []
  for key in sorted(set(saved) | set(expected)):
    old, new = saved.get(key), expected.get(key)
    if isinstance(old, dict) and isinstance(new, dict):
      out += [f"{key}.{d}" for d in _differences(old, new)]
    elif old != new:
      out.append(f"{key}: {old!r} in the file, {new!r} here")
  return out


def load_run(path: pathlib.Path, expected: Optional[Mapping] = None) -> tables.RunResult:
  """A saved ``runs/<key>.npz`` (``save_run``), checked against ``expected`` (``run_setup``).

  A file saved before run setups were recorded is checked by what it holds:
  cell labels, seeds and number of rounds.

  Raises:
    ValueError: naming the file and what differs, if it was saved by
      another run (another folder's, or one with other settings).
  """
  with np.load(path) as f:
    arrays = {name: f[name] for name in tables.RunResult._fields if name in f.files}
    arrays["hparams"] = {k[len("hparam_"):]: f[k] for k in f.files if k.startswith("hparam_")}
    saved = json.loads(str(f["run_setup"])) if "run_setup" in f.files else None
    seeds = f["seeds"].tolist() if "seeds" in f.files else None
  result = tables.RunResult(**arrays)
  if expected is None:
    return result
  if saved is None:
    saved = {"cells": [str(label) for label in result.labels], "seeds": seeds,
             "rounds": int(result.test_acc.shape[2])}
    expected = {key: expected[key] for key in saved}
  diffs = _differences(saved, expected)
  if diffs:
    raise ValueError(f"{path} was saved by another run ({'; '.join(diffs[:4])}"
                     f"{'; ...' if len(diffs) > 4 else ''}); delete it to run "
                     f"{path.stem} again here, or resume the folder it came from")
  return result


def save_run(path: pathlib.Path, arrays: Mapping, cells: cells_lib.Cells,
             federation: Federation, seconds: float,
             setup: Optional[Mapping] = None) -> tables.RunResult:
  """Saves a sweep's per-round arrays with its cells (labels, aggregators, hyper-parameters)
  and, if given, its ``run_setup`` (for ``load_run``'s check)."""
  recorded = {name: np.asarray(arrays[name]) for name in tables.RunResult._fields
              if arrays.get(name) is not None and name not in ("seconds", "labels", "hparams")}
  # Cell values as the user gave them (0.9, not float32's 0.8999999761581421).
  hparams = {n: np.round(v, 6) for n, v in cells.hparam_table().items()}
  result = tables.RunResult(**recorded, labels=np.asarray(cells.labels),
                            aggregators=np.asarray([c.aggregator for c in cells.cells]),
                            hparams=hparams, seconds=seconds)
  report.write_history(path, **{k: v for k, v in result._asdict().items()
                                if k != "hparams" and v is not None},
                       **{f"hparam_{n}": v for n, v in hparams.items()},
                       domains=np.asarray(federation.domains), seeds=np.asarray(federation.seeds),
                       **({} if setup is None else {"run_setup": np.asarray(json.dumps(setup))}))
  return result


def run_cells(config: Config, federation: Federation, cells: cells_lib.Cells, key: str,
              method: str, hparams: Mapping, rounds: int, out_dir: pathlib.Path, setup: Mapping,
              controls: RunControls, record: Optional[dict] = None,
              last: Optional[int] = None) -> tables.RunResult:
  """Runs one method over ``cells`` for all seeds (or loads its finished run) and saves it.

  The sweep checkpoints to ``checkpoint-<key>.msgpack`` and resumes from it.
  With ``record`` (the run's config.json contents), the sweep's plan (devices,
  sub-batches, memory) goes into its ``batches[key]`` and config.json is
  written again. ``last``: the final rounds, always evaluated (needed with
  ``controls.eval_every`` > 1; see ``sweep.run_sweep``).
  """
  path = _run_path(out_dir, key)
  saved = run_setup(config, cells, method, hparams, federation.seeds, rounds)
  if path.exists():
    return load_run(path, saved)
  checkpoint = out_dir / f"checkpoint-{key}.msgpack"

  def on_plan(plan):
    if record is not None:
      record_plan(record, plan, key)
      report.write_json(out_dir / "config.json", record)

  start = time.perf_counter()
  with marks_stopped(out_dir, record):
    history = run_sweep(config, federation, cells, rounds, controls, method=method,
                        method_hparams=dict(hparams), description=key,
                        checkpoint_path=checkpoint, fingerprint=fingerprint({**setup, "run": key}),
                        on_plan=on_plan, last=last)
  result = save_run(path, history._asdict(), cells, federation, time.perf_counter() - start,
                    saved)
  remove_file(checkpoint)
  return result


def _reference_run(name: str) -> tuple[cells_lib.Cells, str]:
  """A reference row's one cell and the method that runs it (the majority row: none trains)."""
  own = cells_lib.Cells([cells_lib.cell(cells_lib.BASE, label=references.DISPLAY[name])])
  return own, {"majority": "majority", "centralized": "fedavg"}.get(name, "local")


def run_reference(name: str, config: Config, federation: Federation, domain_graphs,
                  rounds: int, out_dir: pathlib.Path, setup: Mapping,
                  controls: RunControls, record: Optional[dict] = None,
                  last: Optional[int] = None) -> tables.RunResult:
  """A reference row's run (``references``) on the same seeds and splits, saved like a method's.

  The majority row is scored on the host in every round, whatever
  ``controls.eval_every``; ``record`` and ``last`` as for ``run_cells``.
  """
  own, method = _reference_run(name)
  if name == "majority":
    path = _run_path(out_dir, name)
    saved = run_setup(config, own, method, {}, federation.seeds, rounds)
    if path.exists():
      return load_run(path, saved)
    start = time.perf_counter()
    return save_run(path, references.majority_history(federation, rounds), own, federation,
                    time.perf_counter() - start, saved)
  if name == "centralized":
    federation = build_federation(config, domain_graphs, federation.seeds, pooled=True)
  return run_cells(config, federation, own, name, method, {}, rounds, out_dir, setup, controls,
                   record, last)


def _checked(defaults: Optional[Mapping]) -> dict:
  if defaults is None:
    return methods_lib.method_defaults()
  sections = {key: value for key, value in defaults.items() if key != "source"}
  return methods_lib.check_method_config(sections, defaults.get("source", "method config"))


def _remove_previous(out_dir: pathlib.Path, keys: Sequence[str]) -> None:
  """On --overwrite: deletes this tool's files of the previous run and of the new keys, nothing else."""
  try:
    old = read_record(out_dir, "status")
    keys = list(keys) + list(old.get("methods") or []) + list(old.get("ablation") or {})
  except ValueError:
    pass
  remove_outputs(out_dir, [f"{stem}.{ext}" for stem in ("table", PARTIAL)
                          for ext in ("md", "csv", "tex", "png")]
                 + ["config.json"] + [f"checkpoint-{k}.msgpack" for k in keys]
                 + [f"{RUNS}/{k}.npz" for k in keys] + [f"heatmap-{k}.png" for k in keys])


def _title(config: Config, rounds: int, seeds: Sequence[int], last: int,
           own: Optional[Mapping[str, Sequence[str]]] = None) -> str:
  """The table's title; ``own``: ``{backbone: row labels}`` of rows not on the config's backbone."""
  spread = "± std over seeds" if len(seeds) > 1 else f"± std over the last {last} rounds"
  participation = (f", {config.participation:g} of clients per round"
                   if config.participation < 1 else "")
  backbone = config.backbone + "".join(f" ({b}: {', '.join(labels)})"
                                       for b, labels in (own or {}).items())
  return (f"{config.dataset} {config.setting}, {backbone}, {rounds} rounds, seeds "
          f"{list(seeds)}, mean of the last {last} rounds {spread}{participation}")


def _record(setup: Mapping, federation: Federation, meta: Mapping, controls: RunControls,
            **extra) -> dict:
  return {**setup, **extra, "status": "running", "num_clients": federation.num_clients,
          "nonfinite": controls.nonfinite, "checkpoint_every": controls.checkpoint_every,
          "max_memory": controls.max_memory,
          "eval_every": controls.eval_every,
          "raw_dir": controls.raw_dir and str(controls.raw_dir),
          "cache_dir": controls.cache_dir and str(controls.cache_dir),
          "data": {"source_sha256": meta.get("source_sha256"),
                   "format_version": meta.get("format_version")}, **provenance()}


def _prepare(out_dir: pathlib.Path, config: Config, controls: RunControls, domain_graphs,
             kind: str):
  """Refuses to clobber a run in ``out_dir``; returns the data and its meta."""
  prepare_out_dir(out_dir, controls.resume, controls.overwrite, finished_marker=FINISHED,
                  record_key={"table": "methods", "ablation": "ablation"}[kind])
  meta = {}
  if domain_graphs is None:
    domain_graphs, meta = load_dataset(config.dataset, controls.raw_dir, controls.cache_dir,
                                       controls.verify)
  return domain_graphs, meta


def method_rows(result: tables.RunResult, name: str, aggregators: Sequence[str], select: str,
                last: int) -> list[tables.TableRow]:
  """A method's rows from its run: its own (``base``), then one per aggregator (``select``'s cell).

  The paired deltas are not filled (``tables.add_deltas`` over the whole table).
  """
  rows = [tables.make_row(result, list(result.labels).index(row_label(name)), name, "base", last)]
  for aggregator in aggregators:
    row = tables.make_row(result, tables.select_cell(result, aggregator, select, last), name,
                          f"+{aggregator}", last)
    rows.append(row._replace(label=row_label(name, aggregator)))
  return rows


def run_table(config: Config, method_names: Sequence[str], seeds: Sequence[int], rounds: int,
              last: int, select: str = "fixed", aggregators: Sequence[str] = ("fedia",),
              defaults: Optional[Mapping] = None, controls: RunControls = RunControls(),
              domain_graphs=None) -> pathlib.Path:
  """Runs every method alone and with each aggregator, and the references, and writes the tables.

  Writes into the output folder: ``table.md``, ``table.csv``, ``table.tex``
  (per domain mean±std over seeds of the final ``last`` rounds, AVG, the
  paired change against the base method and against FedAvg), ``table.png``,
  ``config.json``, ``runs/<method>.npz`` (every cell's history) and, with
  ``select="val"``, ``heatmap-<method>.png`` (FedIA's grid).

  Args:
    config: the federation preset and local training recipe.
    method_names: methods (keys of ``methods.METHODS``) and reference rows
      (``references.REFERENCES``), in table order.
    seeds, rounds, last: as for ``experiment.run_grid``.
    select: ``fixed``: each aggregator at the hyper-parameters of
      ``defaults``; ``val``: at the grid cell with the best validation AVG
      (each hyper-parameter over ``GRID``, all in one sweep per method).
    aggregators: what replaces each method's own averaging in its other rows
      (``AGGREGATORS``): ``fedia`` (the paper's "+FedIA"), ``gma``, ``fedheal``.
    defaults: ``methods.method_defaults()`` or an equivalent mapping.
    controls: data and output locations, chunks, checkpoints, policies, the
      evaluation interval (``eval_every`` k > 1: ``runs/*.npz`` hold NaN
      scores and -1 predicted classes in rounds neither a multiple of k nor
      among the last; the tables and ``select`` read only the last).
    domain_graphs: already loaded domain graphs (skips ``load_dataset``).

  Raises:
    ValueError: for a bad method, aggregator, hyper-parameter, selection, seed
      list, rounds or last, or an output folder that holds a run.
  """
  check_run_args(rounds, last, seeds)
  if select not in SELECTIONS:
    raise ValueError(f"select = {select!r}; choose one of {SELECTIONS}")
  if select == "val" and config.split[1] == 0:
    raise ValueError(f"select = 'val' needs validation nodes; split = {list(config.split)} "
                     "gives none")
  defaults = _checked(defaults)
  aggregators = list(aggregators)
  check_methods(method_names, aggregators, config, defaults)
  out_dir = controls.out_dir or default_out_dir(config, "table")
  with claimed(out_dir, controls.resume):
    domain_graphs, meta = _prepare(out_dir, config, controls, domain_graphs, "table")
    federation = build_federation(config, domain_graphs, seeds)
    if controls.overwrite:
      _remove_previous(out_dir, method_names)
    out_dir.mkdir(parents=True, exist_ok=True)

    methods = base_methods(method_names)
    # Rows of a method on its own backbone (FedSPA's SFPD) say so in the title.
    title = _title(config, rounds, seeds, last, _rows_by_backbone(methods, aggregators, config,
                                                                   defaults))
    hparams = {m: methods_lib.run_hparams(m, defaults["hparams"].get(m, {}), rounds)
               for m in methods}
    settings = {m: {a: aggregator_setting(defaults, config.dataset, config.setting, m, a)
                    for a in aggregators} for m in methods}
    setup = {"config": config.to_dict(), "methods": list(method_names), "hparams": hparams,
             "aggregators": aggregators, "settings": settings if select == "fixed" else None,
             "select": select, "seeds": [int(s) for s in seeds], "rounds": rounds,
             "chunk": controls.chunk}
    # Recorded beside the given ones (which the checkpoints' fingerprints hash): each
    # method's every hyper-parameter, its factory's defaults included. A method
    # that finished before a resume keeps what was recorded then: a factory
    # default may have changed since, and its run did not see the change.
    in_effect = {m: methods_lib.hparams_in_effect(m, hparams[m]) for m in methods}
    if controls.resume and (out_dir / "config.json").exists():
      recorded = read_record(out_dir, "methods").get("hparams_in_effect", {})
      in_effect.update({m: recorded[m] for m in methods
                        if m in recorded and _run_path(out_dir, m).exists()})
    record = _record(setup, federation, meta, controls, last=last, hparams_in_effect=in_effect,
                     **earlier_plans(out_dir, controls.resume))
    report.write_json(out_dir / "config.json", record)

    rows, seconds, chosen, chosen_val = [], {}, {}, {}
    for name in method_names:
      if name in references.REFERENCES:
        result = run_reference(name, config, federation, domain_graphs, rounds, out_dir, setup,
                               controls, record, last)
        rows.append(tables.make_row(result, 0, name, "reference", last))
        seconds[name] = float(result.seconds)
        continue
      cells = method_cells(name, aggregators, settings[name], select)
      result = run_cells(config, federation, cells, name, name, hparams[name], rounds, out_dir,
                         setup, controls, record, last)
      own_rows = method_rows(result, name, aggregators, select, last)
      rows += own_rows
      for aggregator, row in zip(aggregators, own_rows[1:]):
        g = tables.select_cell(result, aggregator, select, last)
        chosen.setdefault(name, {})[aggregator] = row.hparam_dict
        chosen_val.setdefault(name, {})[aggregator] = tables.validation_avg(result, g, last)
      seconds[name] = float(result.seconds)
      if select == "val" and "fedia" in aggregators:
        tables.plot_grid_heatmap(result, federation.domains, last, out_dir / f"heatmap-{name}.png",
                                 title, row_label(name),
                                 reported=tables.select_cell(result, "fedia", select, last))
    rows = tables.add_deltas(rows)
    domains = list(federation.domains)
    title += f", hyper-parameters {select}"
    tables.plot_table(rows, out_dir / "table.png", title)
    report.write_json(out_dir / "config.json", {**record, "status": "finished",
                                                "selected": chosen, "selected_val_avg": chosen_val,
                                                "seconds_per_method": seconds})
    tables.write_tables(rows, domains, out_dir / "table", title)
    remove_outputs(out_dir, [f"{PARTIAL}.{ext}" for ext in ("md", "csv", "tex")])  # superseded
    print(tables.to_markdown(rows, domains, title))
    print(f"results in {out_dir}")
    return out_dir


def resume_table(out_dir: pathlib.Path, controls: RunControls = RunControls(),
                 domain_graphs=None, nonfinite: Optional[str] = None) -> pathlib.Path:
  """Continues the unfinished table in ``out_dir``: finished methods are loaded, the running one resumes.

  Raises:
    ValueError: if ``out_dir`` holds no unfinished table run.
  """
  out_dir = pathlib.Path(out_dir)
  record = read_record(out_dir, "methods")
  config = Config(**record["config"])
  fixed = record["settings"] or {}
  # The settings the run started with, in the method config's shape.
  defaults = {"hparams": record["hparams"], "fedia": {
      "default": [0.5, 0.5], config.dataset: {config.setting: {
          m: [s["fedia"]["rho"], s["fedia"]["beta"]] for m, s in fixed.items() if "fedia" in s}}},
      "aggregators": {}, "source": str(out_dir / "config.json")}
  for per_method in fixed.values():
    for aggregator, values in per_method.items():
      if aggregator != "fedia":
        defaults["aggregators"][aggregator] = values
  return run_table(config, record["methods"], record["seeds"], record["rounds"], record["last"],
                   record["select"], record["aggregators"], defaults,
                   resumed(controls, record, out_dir, nonfinite), domain_graphs)


def finished_rows(out_dir: pathlib.Path) -> pathlib.Path:
  """Writes ``partial.md``/``.csv``/``.tex``: the rows of the methods finished so far in a table run.

  Reads only ``config.json`` and ``runs/*.npz`` (no data, no training), so an
  unfinished table can be read while it runs; the methods not finished yet
  are named in the title, and the rows are paired as in the final table
  (no change against FedAvg before FedAvg has finished). The finished
  table removes them (``run_table``), as does ``--overwrite``.

  Raises:
    ValueError: if ``out_dir`` holds no table run or no finished method yet.
  """
  out_dir = pathlib.Path(out_dir)
  record = read_record(out_dir, "methods")
  last = record["last"]
  rows, missing = [], []
  for name in record["methods"]:
    path = _run_path(out_dir, name)
    if not path.exists():
      missing.append(name)
      continue
    config = Config(**record["config"])
    if name in references.REFERENCES:
      (cells, method), hparams = _reference_run(name), {}
    else:
      cells = method_cells(name, record["aggregators"], (record["settings"] or {}).get(name),
                           record["select"])
      method, hparams = name, record["hparams"][name]
    result = load_run(path, run_setup(config, cells, method, hparams, record["seeds"],
                                      record["rounds"]))
    if name in references.REFERENCES:
      rows.append(tables.make_row(result, 0, name, "reference", last))
    else:
      rows += method_rows(result, name, record["aggregators"], record["select"], last)
  if not rows:
    raise ValueError(f"{out_dir}: no method has finished yet (runs/ holds none of "
                     f"{record['methods']})")
  finished = [n for n in record["methods"] if n not in missing]
  own = _rows_by_backbone(base_methods(finished), record["aggregators"], config,
                          {"hparams": record["hparams"]})
  title = (_title(config, record["rounds"], record["seeds"], last, own)
           + f", hyper-parameters {record['select']}"
           + (f"; not finished: {', '.join(missing)}" if missing else ""))
  rows = tables.add_deltas(rows)
  with np.load(_run_path(out_dir, finished[0])) as run:
    domains = [str(d) for d in run["domains"]]
  tables.write_tables(rows, domains, out_dir / PARTIAL, title)
  print(tables.to_markdown(rows, domains, title))
  return out_dir / f"{PARTIAL}.md"


ABLATION = (("FedAvg", cells_lib.BASE), ("FedAvg+IM", "fedia_im"), ("FedAvg+IM+CAM", "fedia"))


def run_ablation(configs: Sequence[Config], seeds: Sequence[int], rounds: int, last: int,
                 defaults: Optional[Mapping] = None, controls: RunControls = RunControls(),
                 domain_graphs=None, aggregators: Sequence[str] = ("fedia",)) -> pathlib.Path:
  """FedAvg, FedAvg+IM and FedAvg+IM+CAM (= FedIA) per setting (FedIA paper, Table 6).

  One compiled sweep per setting runs the three cells for all seeds, with
  FedAvg's (rho, beta) from ``defaults``; each aggregator of ``aggregators``
  other than ``fedia`` (e.g. ``gma``, ``fedheal``) adds a row FedAvg+<rule>
  to the same sweep, with its hyper-parameters from the ``aggregators``
  section of ``defaults``. Non-convergence (NaN accuracy or a
  constant prediction through the final rounds) is reported as NC, not as a
  number. Writes ``table.md``/``.csv``/``.tex`` (all settings, one block
  each), ``table.png``, ``config.json`` and ``runs/<setting>.npz``.

  Args:
    configs: one preset per setting, all of one dataset (e.g. Twitch s1, s3).
    Other arguments: as for ``run_table``.
  """
  check_run_args(rounds, last, seeds)
  if not configs or len({c.dataset for c in configs}) != 1:
    raise ValueError("give at least one setting, all of one dataset")
  defaults = _checked(defaults)
  if "fedia" not in aggregators:
    raise ValueError(f"aggregators = {list(aggregators)}; the ablation is FedIA's, so the list "
                     "must hold fedia (the others add rows beside it)")
  for config in configs:
    check_methods(["fedavg"], aggregators, config, defaults)
  settings = {c.setting: aggregator_setting(defaults, c.dataset, c.setting, "fedavg", "fedia")
              for c in configs}
  others = {a: aggregator_setting(defaults, configs[0].dataset, configs[0].setting, "fedavg", a)
            for a in aggregators if a != "fedia"}
  rows_of = ABLATION + tuple((f"FedAvg+{aggregators_lib.DISPLAY[a]}", a) for a in others)
  out_dir = controls.out_dir or default_out_dir(configs[0], "ablation")
  with claimed(out_dir, controls.resume):
    domain_graphs, meta = _prepare(out_dir, configs[0], controls, domain_graphs, "ablation")
    federations = {c.setting: build_federation(c, domain_graphs, seeds) for c in configs}
    if controls.overwrite:
      _remove_previous(out_dir, list(settings))
    out_dir.mkdir(parents=True, exist_ok=True)
    hparams = dict(defaults["hparams"].get("fedavg", {}))
    setup = {"configs": [c.to_dict() for c in configs], "ablation": settings, "hparams": hparams,
             "aggregators": others, "seeds": [int(s) for s in seeds], "rounds": rounds,
             "chunk": controls.chunk}
    record = _record(setup, federations[configs[0].setting], meta, controls, last=last,
                     **earlier_plans(out_dir, controls.resume))
    report.write_json(out_dir / "config.json", record)

    markdown, csv_text, latex, all_rows = [], [], [], []
    for config in configs:
      fedia = settings[config.setting]
      cells = cells_lib.Cells([
          cells_lib.cell(aggregator, label=label, **(
              others[aggregator] if aggregator in others
              else {n: fedia[n] for n in aggregators_lib.get(aggregator).hparams}))
          for label, aggregator in rows_of])
      result = run_cells(config, federations[config.setting], cells, config.setting, "fedavg",
                         hparams, rounds, out_dir, setup, controls, record, last)
      rows = tables.add_deltas([
          tables.make_row(result, cells.index(label), "fedavg",
                          "base" if aggregator == cells_lib.BASE else f"+{aggregator}", last)
          for label, aggregator in rows_of])
      domains = list(federations[config.setting].domains)
      title = (_title(config, rounds, seeds, last)
               + f", ρ={fedia['rho']:g}, β={fedia['beta']:g}")
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


def resume_ablation(out_dir: pathlib.Path, controls: RunControls = RunControls(),
                    domain_graphs=None, nonfinite: Optional[str] = None) -> pathlib.Path:
  """Continues the unfinished ablation in ``out_dir`` with its own config.json."""
  out_dir = pathlib.Path(out_dir)
  record = read_record(out_dir, "ablation")
  configs = [Config(**c) for c in record["configs"]]
  others = record.get("aggregators", {})
  defaults = {"hparams": {"fedavg": record["hparams"]}, "aggregators": others, "fedia": {
      "default": [0.5, 0.5], configs[0].dataset: {
          s: {"fedavg": [v["rho"], v["beta"]]} for s, v in record["ablation"].items()}}}
  return run_ablation(configs, record["seeds"], record["rounds"], record["last"], defaults,
                      resumed(controls, record, out_dir, nonfinite), domain_graphs,
                      aggregators=["fedia", *others])
