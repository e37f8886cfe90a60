"""The job's hosts: how they are given (``-H``, hostfiles, batch allocations), how ringrun
reaches them (ssh) and what a host reports about itself (its interfaces, its Python)."""
