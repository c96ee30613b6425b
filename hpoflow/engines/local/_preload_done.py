"""The last module the local engine's forkserver imports (after ``_preload`` and any other preload):
it notes what is loaded for the workers' module reset (``_modules.note_preloaded``: found once here,
not looked at again in each worker, which would make those shared pages its own) and moves everything
out of the collector's reach (``gc.freeze``), so the workers forked afterwards share it untouched.
"""

from __future__ import annotations

import gc

from hpoflow.engines.local._modules import note_preloaded

note_preloaded()
gc.collect()
gc.freeze()
