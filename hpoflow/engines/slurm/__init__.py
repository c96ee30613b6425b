"""The slurm engine: each trial a SLURM job step of the driver's allocation (``steps``) or its own batch
job (``jobs``); see ``engine``. ``options`` is the ``engine_options`` model, ``allocation`` reads the
allocation SLURM gives a batch script, ``launch`` writes the driver's batch script (``hpoflow launch
--engine slurm``). The cluster parts it shares with the compss engine are ``hpoflow.engines.cluster``.
"""
