"""The harness: everything that runs experiments on top of the settings.

* `train`: the training loop (the `Task` protocol), metric writers, checkpoints;
* `configs`: the experiment configs shipped in the package, addressable by name;
* `cli`: the `sera-jax` command; `sweep`: grids of runs;
* `plotting`: figures of run directories;
* `figures`: the figure experiments (`sera-jax figure NAME`).
"""
