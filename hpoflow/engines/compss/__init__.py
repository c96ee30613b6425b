"""The compss engine: one PyCOMPSs task per trial, placed by the COMPSs runtime on nodes and GPUs.

Its modules follow the three processes of a COMPSs run:

- the driver side, in the application process that ``runcompss`` starts (``workflows/hpo.py``):
  ``engine`` (``CompssEngine``), ``options`` (the ``compss:`` section) and ``shape`` (what each
  trial's task registers with the runtime);
- inside the task, on a worker: ``tasks`` (the decorated task functions the runtime calls), whose body
  ``placement.run_task`` gives back a multi-node placement with a repeated host, else runs one
  attempt of the trial with ``hpoflow.engines.cluster`` (shared with the SLURM engine);
- before the runtime starts: ``launch`` (``hpoflow launch``: the command line, the site config, the
  workers a trial must fit, the XML).

The only package of hpoflow that imports pycompss, and only when a task is submitted under the
runtime: importing it needs no pycompss (``workflows/hpo.py`` falls back to a sequential mode).
See docs/cluster.md.
"""

from __future__ import annotations

from hpoflow.engines.compss._api import pycompss_available, runtime_active
from hpoflow.engines.compss.engine import CompssEngine
from hpoflow.engines.compss.options import CompssOptions
from hpoflow.engines.compss.shape import TaskShape

__all__ = ["CompssEngine", "CompssOptions", "TaskShape", "pycompss_available", "runtime_active"]
