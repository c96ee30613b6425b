"""The version of hpoflow (one place: the package, run.json and ``hpoflow --version`` read it)."""

__version__ = "0.1.0"
