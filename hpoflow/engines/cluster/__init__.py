"""What every cluster engine needs to run one trial over several nodes, whoever placed it (COMPSs or
SLURM): ``layout`` (the cores and GPUs a task was bound to, the rank layout, the host order, the
interface the ranks share, and the ``srun``/``mpirun``/``ssh`` command lines that start one node
launcher per node), ``node`` (the node launcher and rank processes, ``python -m
hpoflow.engines.cluster.node``) and ``attempt`` (one attempt of a trial inside its task or job: plan,
launch, supervise, reap, and write the result to the shared run directory).

Nothing here imports pycompss, and torch only inside a rank process.
"""
