"""Every kind of collective: its request builders (host arrays, GPU buffers), its blocking
form, and its object (how it runs on host buffers and on the GPU, what a joined rank
contributes, how it describes itself), registered with `kinds.kind`. A kind is one module,
or one package when it has several paths (`allreduce`).

Importing a kind's module registers it; `core.collectives` imports every one.
"""
