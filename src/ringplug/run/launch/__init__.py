"""Running a job: the MPI launcher's command line, the per-rank wrapper, the rank events and
output that come back, the teardown, restarts (elastic) and Lightning's re-run under ringrun."""
