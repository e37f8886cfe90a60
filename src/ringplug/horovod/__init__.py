"""Horovod's API on ringplug: ``import ringplug.horovod.torch as hvd`` (``.keras``,
``.tensorflow``, ``.tensorflow.keras``) in place of ``import horovod.torch as hvd``, and
``ringrun`` in place of ``horovodrun``. docs/horovod.md lists every name and what differs.
"""
