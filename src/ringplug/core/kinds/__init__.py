"""Every kind of collective in one module each: its request builders (host arrays, GPU
buffers), its blocking form, and its object (how it runs on host buffers and on the GPU,
what a joined rank contributes, how it describes itself), registered with `core.kind`.

Importing this package registers every kind.
"""

from . import allgather, allreduce, alltoall, barrier, broadcast, objects, reducescatter

__all__ = ["allgather", "allreduce", "alltoall", "barrier", "broadcast", "objects", "reducescatter"]
