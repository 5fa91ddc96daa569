"""How the trained demo checkpoint `demo/parent` is built and judged, run from the repository root as modules:
the corpus (`python -m demo_build.prepare_corpus`, `demo_build.package_corpus`), training and packaging
(`demo_build.train_demo`), evaluation (`demo_build.eval_demo`, `demo_build.exec_eval`) and the experiments that
chose its recipe and decoding (`demo_build.domain_anneal`, `demo_build.tune_decoding`). Results in
`demo_build/results/`."""
