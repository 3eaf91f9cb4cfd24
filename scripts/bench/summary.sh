# Reading a run's own figures, for the benchmarks (sourced by lib.sh) and scripts/gpu/check.sh,
# which runs where nothing is built and cannot source lib.sh. PYTHON: the interpreter (python3).

# The training samples/s a run reported in its summary: summary_samples_per_s RUN_DIR
summary_samples_per_s() {
  "${PYTHON:-python3}" -c 'import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; print(round(next(x for x in r if x.get("kind")=="summary")["samples_per_s"]))' "$1/metrics.jsonl"
}
