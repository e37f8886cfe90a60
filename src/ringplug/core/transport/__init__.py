"""The host data plane: moving bytes between ranks once they agreed what to move.

`host` (every collective's data phase over MPI), `ring` (the ring-allreduce), `reduce` (the
kernels that combine two ranks' data), `waiting` (every wait with its deadline, and the
notices a failing rank sends).
"""
