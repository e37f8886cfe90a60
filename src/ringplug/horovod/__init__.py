"""Horovod's API on ringplug, for moving a Horovod training script with one import line:

- ``import horovod.torch as hvd`` -> ``import ringplug.horovod.torch as hvd``
- ``import horovod.keras as hvd`` / ``horovod.tensorflow.keras`` ->
  ``import ringplug.horovod.keras as hvd``
- ``horovodrun -np 4 python train.py`` -> ``ringrun -np 4 python train.py``

See docs/horovod.md for what is supported and what differs.
"""
