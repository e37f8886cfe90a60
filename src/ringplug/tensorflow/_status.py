"""A graph op that fails with ``FAILED_PRECONDITION``, as Horovod's collective kernels do.

Inside a graph (``tf.function``, a TF1 session) a collective runs as a stateful
``tf.numpy_function``. TensorFlow's py_func kernel turns an exception raised there into
``InvalidArgument`` (``ValueError``, ``TypeError``) or ``Unknown`` (anything else,
``tf.errors.OpError`` included: the kernel looks at Python's built-in exception types
only), so ringplug's mismatch errors cannot leave that op as the
``tf.errors.FailedPreconditionError`` that Horovod's users catch.

So the collective's numpy function does not raise its `RingplugError`: it files the
message under a ticket, returns the ticket as one more output, and an op registered here
(``RingplugCheck``, through TensorFlow's C API for ops and kernels in
libtensorflow_framework) fails the step with code ``FAILED_PRECONDITION`` and that message
when its ticket is not 0. The collective's outputs are gated on the check, so nothing
reads them when it fails. The kernel is a Python callback (ctypes takes the GIL for it,
as the py_func kernel does); it reads one int64.

Where the C API is not there (a TensorFlow built without it, a registration refused), the
collectives raise inside the numpy function as before: `available` says which.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import threading
from typing import Any

import tensorflow as tf

_log = logging.getLogger(__name__)

_OP = "RingplugCheck"
_FAILED_PRECONDITION = 9  # TF_Code in tensorflow/c/tf_status.h (error_codes.proto)

_lock = threading.Lock()
_tickets = itertools.count(1)
_failures: dict[int, str] = {}  # ticket -> message, until the check op reads it
_state: dict[str, Any] = {}  # "ok": bool once registration was tried; "why" if it failed


def _bind(lib: ctypes.CDLL) -> None:
    """Declare the C signatures used here (ctypes would guess int for every pointer)."""
    ptr, text = ctypes.c_void_p, ctypes.c_char_p
    signatures = {
        "TF_NewStatus": ([], ptr),
        "TF_DeleteStatus": ([ptr], None),
        "TF_SetStatus": ([ptr, ctypes.c_int, text], None),
        "TF_GetCode": ([ptr], ctypes.c_int),
        "TF_Message": ([ptr], text),
        "TF_NewOpDefinitionBuilder": ([text], ptr),
        "TF_OpDefinitionBuilderAddInput": ([ptr, text], None),
        "TF_OpDefinitionBuilderSetIsStateful": ([ptr, ctypes.c_bool], None),
        "TF_OpDefinitionBuilderSetShapeInferenceFunction": ([ptr, ptr], None),
        "TF_RegisterOpDefinition": ([ptr, ptr], None),
        "TF_NewKernelBuilder": ([text, text, ptr, _COMPUTE, ptr], ptr),
        "TF_RegisterKernelBuilder": ([text, ptr, ptr], None),
        "TF_GetInput": ([ptr, ctypes.c_int, ctypes.POINTER(ptr), ptr], None),
        "TF_TensorData": ([ptr], ptr),
        "TF_DeleteTensor": ([ptr], None),
        "TF_OpKernelContext_Failure": ([ptr, ptr], None),
    }
    for name, (args, result) in signatures.items():
        function = getattr(lib, name)  # AttributeError: this TensorFlow lacks the C API
        function.argtypes = args
        function.restype = result


_COMPUTE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)


def _compute(lib: ctypes.CDLL) -> Any:
    """The kernel: fail with the filed message when the ticket input is not 0."""

    def compute(kernel: int, context: int) -> None:
        status = lib.TF_NewStatus()
        try:
            tensor = ctypes.c_void_p()
            lib.TF_GetInput(context, 0, ctypes.byref(tensor), status)
            if lib.TF_GetCode(status) != 0:
                lib.TF_OpKernelContext_Failure(context, status)
                return
            ticket = ctypes.c_int64.from_address(lib.TF_TensorData(tensor)).value
            lib.TF_DeleteTensor(tensor)
            if ticket == 0:
                return
            with _lock:
                message = _failures.pop(ticket, None)
            if message is None:  # filed by another process's graph: cannot happen in one
                message = f"ringplug: collective failed (ticket {ticket} has no message)."
            lib.TF_SetStatus(status, _FAILED_PRECONDITION, message.encode("utf-8", "replace"))
            lib.TF_OpKernelContext_Failure(context, status)
        finally:
            lib.TF_DeleteStatus(status)

    return _COMPUTE(compute)


def _register() -> None:
    lib = ctypes.CDLL(os.path.join(tf.sysconfig.get_lib(), "libtensorflow_framework.so.2"))
    _bind(lib)
    status = lib.TF_NewStatus()
    try:
        builder = lib.TF_NewOpDefinitionBuilder(_OP.encode())
        lib.TF_OpDefinitionBuilderAddInput(builder, b"ticket: int64")
        lib.TF_OpDefinitionBuilderSetIsStateful(builder, True)
        # No outputs to shape: TensorFlow's own UnknownShape has the shape function's C
        # signature, so no Python callback runs while graphs are built.
        unknown = ctypes.cast(lib.TF_ShapeInferenceContextSetUnknownShape, ctypes.c_void_p)
        lib.TF_OpDefinitionBuilderSetShapeInferenceFunction(builder, unknown)
        lib.TF_RegisterOpDefinition(builder, status)  # frees the builder
        if lib.TF_GetCode(status) != 0:
            raise RuntimeError(lib.TF_Message(status).decode())
        compute = _compute(lib)
        kernel = lib.TF_NewKernelBuilder(_OP.encode(), b"CPU", None, compute, None)
        lib.TF_RegisterKernelBuilder(f"{_OP}CPU".encode(), kernel, status)
        if lib.TF_GetCode(status) != 0:
            raise RuntimeError(lib.TF_Message(status).decode())
        _state["keep"] = (lib, compute)  # TensorFlow calls `compute` for the process's life
    finally:
        lib.TF_DeleteStatus(status)


def available() -> bool:
    """Whether graph collectives can fail with ``FailedPreconditionError`` (registers the
    check op the first time)."""
    return register_once(
        _state,
        _lock,
        _register,
        f"graph collectives will fail with UnknownError rather than FailedPreconditionError "
        f"({_OP} could not be registered",
    )


def register_once(
    state: dict[str, Any], lock: threading.Lock, register: Any, consequence: str
) -> bool:
    """Call `register` the first time only; whether it worked. A failure is logged once, as
    `consequence` followed by the reason, and remembered in ``state["why"]``."""
    with lock:
        if "ok" not in state:
            try:
                register()
                state["ok"] = True
            except (OSError, AttributeError, RuntimeError) as exc:
                state["ok"], state["why"] = False, str(exc)
                _log.warning("ringplug: %s: %s).", consequence, exc)
        return bool(state["ok"])


def file_failure(message: str) -> int:
    """Keep `message` for the check op; the ticket to return in its place."""
    with _lock:
        ticket = next(_tickets)
        _failures[ticket] = message
    return ticket


def gated(ticket: Any, outputs: list[Any]) -> list[Any]:
    """`outputs` that are read only once the check of `ticket` has passed."""
    from tensorflow.python.framework import op_def_library  # how generated ops build

    _, _, check, _ = op_def_library._apply_op_helper(_OP, ticket=ticket)
    with tf.control_dependencies([check]):
        return [tf.identity(output) for output in outputs]
