"""What runs next: ``space`` (search spaces as Optuna distributions, conditions, the exact grid),
``samplers`` (every algorithm an Optuna sampler, every pruner Optuna's) and their ``options``,
``warm_start`` (an earlier run as prior knowledge), and ``driver``: the loop that asks for
configurations, keeps trials in flight on an engine and tells results back.

Import the module you need: ``hpoflow.search.options`` is read by the spec and must stay light, so
this package imports nothing itself.
"""
