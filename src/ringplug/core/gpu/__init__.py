"""The GPU plane: NCCL on the GPU, the CUDA runtime, device buffers, library lookup.

`plane` (the GPU collectives of an engine), `nccl` (the NCCL library through ctypes),
`cuda` (the CUDA runtime calls it needs), `device` (device buffers), `libraries` (finding
the shared libraries). Only GPU jobs import these modules.
"""
