"""RingEnvironment: the MPI launcher's world as Lightning sees it (the Trainer uses Fabric's
cluster-environment classes, so one class serves both; it lives in `ringplug.fabric`)."""

from ..fabric.environment import RingEnvironment

__all__ = ["RingEnvironment"]
