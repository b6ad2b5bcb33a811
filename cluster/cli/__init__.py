"""The entry points, the top layer: the command line (`main`: `python -m cluster plan | build-model | bench | run`),
the launcher that starts a cluster from a deploy file (`launch`), the benchmarks (`bench/`) and the tiny-model
builder (`tiny_model`). They import the Ray runtime (`actors/`) and the pure core (`cluster/core/`); nothing below
imports them."""
