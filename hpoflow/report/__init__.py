"""What a study leaves for people: ``tables`` (``trials.csv``, ``best.yaml``, status, the best trials),
``progress`` (the live display), ``outputs`` (the files written when a run ends), ``html`` (``hpoflow
report``: one self-contained page of plots) and ``tracking`` (MLflow, TensorBoard).

Everything here reads the study from its Optuna storage, so it works on a finished run, a running one
(from another process) and an interrupted one alike. Import the module you need; this package
imports nothing itself.
"""
