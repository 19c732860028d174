#!/usr/bin/env bash
# The accelerator run (issue 12 item 8): the full Twitch S3 grid, 25 FedIA cells (rho x beta in
# 0.1..0.9) + FedAvg, x 5 seeds x 200 rounds as one compiled program, then the vectorised round
# against a Python loop over clients on the same device.
#
#   experiments/bench_gpu.sh                      # the full run (goal: < 60 s on one H200)
#   experiments/bench_gpu.sh --set precision=bf16 # extra flags go to both bench.py calls
#   ROUNDS=2 SEEDS=0 GRID=0.5 LOOP_ROUNDS=1 experiments/bench_gpu.sh   # CPU smoke test
#   DATASET=wikinet SETTING=default ROUNDS=2 SEEDS=0 GRID=0.5 LOOP_ROUNDS=1 experiments/bench_gpu.sh
#
# Environment (defaults in brackets): DATASET [twitch], SETTING [s3], ROUNDS [200],
# SEEDS [0,1,2,3,4], GRID, the rho and beta values
# [0.1,0.3,0.5,0.7,0.9], LOOP_ROUNDS, rounds of the loop comparison [3] (FedAvg + FedIA(0.5, 0.5),
# seed 0), FEDJAX_GRAPH_RAW [../shared/datasets/musae], FEDJAX_GRAPH_CACHE (the prepared-data
# cache; bench.py's default when unset), PYTHON [python]. Needs a JAX with the accelerator's plugin
# (e.g. pip install "jax[cuda12]"); `python -c "import jax; print(jax.devices())"` should list it.
#
# Prints (lines to grep): "wall time ... compile ~... round-cells/s" and "peak memory" of the full
# run (FULL_RUN {...} as JSON), then "speed-up (round-cells/s): ...x; results match: ..." of the
# loop comparison.
set -euo pipefail
cd "$(dirname "$0")/.."

DATASET=${DATASET:-twitch}
SETTING=${SETTING:-s3}
ROUNDS=${ROUNDS:-200}
SEEDS=${SEEDS:-0,1,2,3,4}
GRID=${GRID:-0.1,0.3,0.5,0.7,0.9}
LOOP_ROUNDS=${LOOP_ROUNDS:-3}
RAW=${FEDJAX_GRAPH_RAW:-../shared/datasets/musae}
PYTHON=${PYTHON:-python}
CACHE=()
if [[ -n "${FEDJAX_GRAPH_CACHE:-}" ]]; then CACHE=(--cache-dir "$FEDJAX_GRAPH_CACHE"); fi

"$PYTHON" -c "import jax; print('jax', jax.__version__, jax.devices())"
start=$(date +%s)
"$PYTHON" experiments/bench.py --dataset "$DATASET" --setting "$SETTING" --raw-dir "$RAW" "${CACHE[@]}" \
    --rho "$GRID" --beta "$GRID" --seeds "$SEEDS" --full-run "$ROUNDS" "$@"
"$PYTHON" experiments/bench.py --dataset "$DATASET" --setting "$SETTING" --raw-dir "$RAW" "${CACHE[@]}" \
    --rho 0.5 --beta 0.5 --seeds 0 --rounds "$LOOP_ROUNDS" --skip-schedule --skip-breakdown "$@"
echo "bench_gpu.sh: $(( $(date +%s) - start )) s in all (both processes, data loading included)"
