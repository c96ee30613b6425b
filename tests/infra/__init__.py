"""Real test infrastructure: network namespaces on a bridge, a SLURM cluster in them, a PostgreSQL server."""
