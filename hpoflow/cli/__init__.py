"""Command-line interface: ``hpoflow run | validate | status | launch | oracle``."""
