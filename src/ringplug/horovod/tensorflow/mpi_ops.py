"""Horovod's ``horovod.tensorflow.mpi_ops``, as far as code outside Horovod reaches into it:
the ops are `ringplug.horovod.tensorflow`'s, and ``_basics`` answers
``_get_process_set_ids_and_ranks()``."""

from __future__ import annotations

import types

from .. import _common

_basics = types.SimpleNamespace(
    _get_process_set_ids_and_ranks=_common._get_process_set_ids_and_ranks
)
