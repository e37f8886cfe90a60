"""What ringrun checks before and instead of a job: the preflight of the hosts, the
``--check`` report (this machine, its GPUs, the hosts) and the ``--bench`` ceiling."""
