"""A study's life on disk: ``rundir`` (one run directory however it is spelled, its lock, the status
snapshot, redacted storage URLs), ``storage`` (the Optuna storage: a journal file in the run directory
or a database URL), ``journal`` (that file kept whole), ``retry`` (outages waited out), ``open`` (the
resume checks, opening a run to run or to read) and ``ledger`` (the trial attributes hpoflow writes,
and which trials count against ``n_trials``).

Import the module you need; this package imports nothing itself.
"""
