"""Quiver's benchmarks, run as modules from the repository root (``python -m benchmarks.soak``;
``benchmarks/README.md`` lists them). What they share is in :mod:`benchmarks.common` (reporting,
the plotting venv, the test suite's helpers), :mod:`benchmarks.peers` (starting and stopping
servers: :class:`benchmarks.peers.quiver.QuiverServer` for ``quiver serve``),
:mod:`benchmarks.loadgen` (the load generator) and :mod:`benchmarks.plots` (the plots)."""
