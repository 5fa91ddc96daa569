"""Speed benchmarks of the Kimi K3 code, run from the repository root as modules: `python -m bench.layer`,
`python -m bench.decode`, ... (`bench/run_h200.sh` runs the GPU set); their shared helpers are `bench.common`, their
results and the notes on them are in `bench/results/`."""
