"""Where a job is stuck: the ranks' Python stacks and their last collectives.

- :mod:`ringplug.forensics.stacks` takes a process's stacks, from inside (the interpreter's
  own frames) or from outside (a signal that `faulthandler` answers in C, without the
  interpreter lock), with the process's state from the OS, and prints them grouped by rank.
- :mod:`ringplug.forensics.flight` is each rank's flight record (its last collectives with
  their call sites and times) and ``python -m ringplug.forensics FILE``, which says which
  collective the ranks parted at.

Standard library only: ringrun's per-rank wrapper imports it, and it must not start MPI.
"""
