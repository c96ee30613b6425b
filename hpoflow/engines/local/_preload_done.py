"""The last module the local engine's forkserver imports (after ``_preload`` and any other preload):
it ends the parent watch of ``_preload_guard`` and turns the cyclic collector back on (it was off for
the preload), notes what is loaded for the workers' module reset (``_modules.note_preloaded``: found
once here, not looked at again in each worker, which would make those shared pages its own), collects
once and moves everything out of the collector's reach (``gc.freeze``), so the workers forked
afterwards share it untouched. Last, it unmaps the library pages that only the imports touched
(``_pages.drop_clean_file_pages``).
"""

from __future__ import annotations

import gc

from hpoflow.engines.local import _preload_guard
from hpoflow.engines.local._modules import note_preloaded
from hpoflow.engines.local._pages import drop_clean_file_pages

_preload_guard.remove()  # the forkserver's loop watches its parent from here on; the collector is on again
note_preloaded()
gc.collect()
gc.freeze()
drop_clean_file_pages()
