"""The graph op every collective becomes inside a ``tf.function`` or a TF1 graph: an
asynchronous kernel that holds no TensorFlow thread while the other ranks catch up.

A kernel that blocks while it waits (a ``tf.numpy_function``) keeps one of TensorFlow's
inter-op threads, and that pool is small (one thread per core, fixed when TensorFlow starts
it). A ``session.run`` with more concurrent collectives than threads, created in different
orders on different ranks, left every thread of each rank waiting in a collective the other
rank could not reach: measured, 16 allreduces with 2 inter-op threads on 2 ranks waited
until ``RINGPLUG_TIMEOUT``.

So the op ``RingplugCollective`` is registered through TensorFlow's C API for asynchronous
kernels (``TF_NewAsyncKernelBuilder`` in libtensorflow_framework; no compile step). Its
compute function, a Python callback, submits the collective to ringplug's engine and
returns at once; when the engine has finished it, a thread of this module fills the op's
outputs (or fails it: ``FailedPreconditionError`` for a mismatch, as eagerly) and calls
TensorFlow's done callback, which lets the graph go on.

The one thing the C API does not give: it hands the done callback over as a pointer to
the ``std::function`` argument of ``AsyncOpKernel::ComputeAsync``, which lives only until
that call returns. The callback is therefore moved out of it first, as libstdc++'s own
move constructor does (its ``std::function`` is 16 bytes of functor storage, a manager and
an invoker; a move copies the 32 bytes and clears the source's manager and invoker, and a
functor is stored in place only when it is trivially copyable), and destroyed after it ran
through its manager. `available` checks what that relies on (Linux, TensorFlow's header
declaring ``DoneCallback`` a ``std::function<void()>``, the C API functions) and otherwise
leaves graph collectives to the blocking ``tf.numpy_function`` of `ringplug.tensorflow._ops`.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from ..core.errors import RingplugError
from ._status import register_once

_log = logging.getLogger(__name__)

OP = "RingplugCollective"
_FAILED_PRECONDITION, _INVALID_ARGUMENT, _INTERNAL = 9, 3, 13  # TF_Code (tf_status.h)

# libstdc++'s std::function<void()>: _Any_data (16 bytes), _M_manager, _M_invoker.
_FUNCTION_BYTES, _MANAGER_AT = 32, 16
_DESTROY_FUNCTOR = 3  # std::_Manager_operation::__destroy_functor
_MANAGER = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)

_CREATE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_COMPUTE_ASYNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_DELETE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

Submit = Callable[[list[np.ndarray]], Any]  # arrays -> a `_ops.Started`

_lock = threading.Lock()
_keys = itertools.count(1)
# An op's "key" attribute -> what it submits, for as long as the graph that holds the op
# lives (it keeps them: `collective`), as TensorFlow keeps a numpy_function's function.
_submitters: weakref.WeakValueDictionary[int, Submit] = weakref.WeakValueDictionary()
_held: weakref.WeakKeyDictionary[Any, list[Submit]] = weakref.WeakKeyDictionary()
_state: dict[str, Any] = {}  # "ok" once registration was tried, "why" if it failed
_finished: queue.SimpleQueue[_Call] = queue.SimpleQueue()


def _bind(lib: ctypes.CDLL) -> None:
    """Declare the C signatures used here (ctypes would guess int for every pointer)."""
    ptr, text, i64 = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64
    signatures = {
        "TF_NewStatus": ([], ptr),
        "TF_DeleteStatus": ([ptr], None),
        "TF_SetStatus": ([ptr, ctypes.c_int, text], None),
        "TF_GetCode": ([ptr], ctypes.c_int),
        "TF_Message": ([ptr], text),
        "TF_NewOpDefinitionBuilder": ([text], ptr),
        "TF_OpDefinitionBuilderAddInput": ([ptr, text], None),
        "TF_OpDefinitionBuilderAddOutput": ([ptr, text], None),
        "TF_OpDefinitionBuilderAddAttr": ([ptr, text], None),
        "TF_OpDefinitionBuilderSetIsStateful": ([ptr, ctypes.c_bool], None),
        "TF_OpDefinitionBuilderSetShapeInferenceFunction": ([ptr, ptr], None),
        "TF_RegisterOpDefinition": ([ptr, ptr], None),
        "TF_NewAsyncKernelBuilder": ([text, text, _CREATE, _COMPUTE_ASYNC, _DELETE], ptr),
        "TF_RegisterKernelBuilder": ([text, ptr, ptr], None),
        "TF_RunAsyncOpKernelDoneCallback": ([ptr], None),
        "TF_OpKernelConstruction_GetAttrInt64": ([ptr, text, ctypes.POINTER(i64), ptr], None),
        "TF_NumInputs": ([ptr], ctypes.c_int),
        "TF_GetInput": ([ptr, ctypes.c_int, ctypes.POINTER(ptr), ptr], None),
        "TF_TensorType": ([ptr], ctypes.c_int),
        "TF_NumDims": ([ptr], ctypes.c_int),
        "TF_Dim": ([ptr, ctypes.c_int], i64),
        "TF_TensorData": ([ptr], ptr),
        "TF_TensorByteSize": ([ptr], ctypes.c_size_t),
        "TF_DeleteTensor": ([ptr], None),
        "TF_AllocateOutput": (
            [ptr, ctypes.c_int, ctypes.c_int, ctypes.POINTER(i64), ctypes.c_int, ctypes.c_size_t]
            + [ptr],
            ptr,
        ),
        "TF_OpKernelContext_Failure": ([ptr, ptr], None),
    }
    for name, (args, result) in signatures.items():
        function = getattr(lib, name)  # AttributeError: this TensorFlow lacks the C API
        function.argtypes = args
        function.restype = result


def _done_is_a_std_function() -> None:
    """Raise unless what `_Call` moves is libstdc++'s ``std::function<void()>``."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"the done callback's layout is known on Linux only, not {sys.platform}")
    header = Path(tf.sysconfig.get_include(), "tensorflow/core/framework/op_kernel.h")
    if header.is_file() and "typedef std::function<void()> DoneCallback;" not in header.read_text(
        errors="replace"
    ):
        raise RuntimeError(f"{header} no longer declares DoneCallback a std::function<void()>")


class _Call:
    """One run of the op: its inputs, its moved done callback, its collective in flight."""

    __slots__ = ("context", "done", "inputs", "started", "failure")

    def __init__(self, context: int, done: int) -> None:
        self.context = context
        # Moved out of ComputeAsync's argument, which is destroyed when the callback returns.
        self.done = (ctypes.c_char * _FUNCTION_BYTES)()
        ctypes.memmove(self.done, done, _FUNCTION_BYTES)
        ctypes.memset(done + _MANAGER_AT, 0, _FUNCTION_BYTES - _MANAGER_AT)
        self.inputs: list[int] = []  # TF_Tensor pointers, kept until the op is done
        self.started: Any = None
        self.failure: tuple[int, str] | None = None


def _arrays(lib: ctypes.CDLL, call: _Call, status: int) -> list[np.ndarray]:
    """The op's inputs as read-only numpy views of TensorFlow's buffers."""
    arrays = []
    for index in range(lib.TF_NumInputs(call.context)):
        tensor = ctypes.c_void_p()
        lib.TF_GetInput(call.context, index, ctypes.byref(tensor), status)
        if lib.TF_GetCode(status) != 0:
            raise RuntimeError(lib.TF_Message(status).decode())
        call.inputs.append(tensor.value)
        dtype = np.dtype(tf.dtypes.as_dtype(lib.TF_TensorType(tensor)).as_numpy_dtype)
        shape = tuple(lib.TF_Dim(tensor, d) for d in range(lib.TF_NumDims(tensor)))
        size = lib.TF_TensorByteSize(tensor)
        if size == 0:
            array = np.empty(shape, dtype)
        else:
            raw = (ctypes.c_char * size).from_address(lib.TF_TensorData(tensor))
            array = np.frombuffer(raw, dtype=dtype).reshape(shape)
        array.flags.writeable = False  # TensorFlow's tensor: other ops may read it too
        arrays.append(array)
    return arrays


def _fill(lib: ctypes.CDLL, call: _Call, results: Sequence[Any], status: int) -> None:
    for index, result in enumerate(results):
        result = np.asarray(result, order="C")  # ascontiguousarray makes scalars 1-d
        dims = (ctypes.c_int64 * max(result.ndim, 1))(*result.shape)
        code = tf.dtypes.as_dtype(result.dtype).as_datatype_enum
        tensor = lib.TF_AllocateOutput(
            call.context, index, code, dims, result.ndim, result.nbytes, status
        )
        if lib.TF_GetCode(status) != 0:
            raise RuntimeError(lib.TF_Message(status).decode())
        try:
            if result.nbytes:
                ctypes.memmove(lib.TF_TensorData(tensor), result.ctypes.data, result.nbytes)
        finally:
            lib.TF_DeleteTensor(tensor)


def _failure(exc: BaseException) -> tuple[int, str]:
    """A ringplug failure as the status code a collective fails with (as `_ops.failed`)."""
    if isinstance(exc, RingplugError):
        return _FAILED_PRECONDITION, str(exc)
    if isinstance(exc, (ValueError, TypeError)):
        return _INVALID_ARGUMENT, str(exc)
    return _INTERNAL, f"ringplug: {type(exc).__name__}: {exc}"


def _finish(lib: ctypes.CDLL, call: _Call) -> None:
    """Fill the outputs (or fail the op), let TensorFlow go on, free what the call held."""
    status = lib.TF_NewStatus()
    try:
        if call.failure is None:
            try:
                _fill(lib, call, call.started.wait(), status)
            except Exception as exc:  # noqa: BLE001 - TensorFlow must hear of any failure
                call.failure = _failure(exc)
        if call.failure is not None:
            code, message = call.failure
            lib.TF_SetStatus(status, code, message.encode("utf-8", "replace"))
            lib.TF_OpKernelContext_Failure(call.context, status)
        for tensor in call.inputs:
            lib.TF_DeleteTensor(tensor)
        call.inputs = []
    finally:
        lib.TF_DeleteStatus(status)
        done = ctypes.addressof(call.done)
        lib.TF_RunAsyncOpKernelDoneCallback(done)
        manager = ctypes.c_void_p.from_buffer(call.done, _MANAGER_AT).value
        if manager:
            _MANAGER(manager)(done, done, _DESTROY_FUNCTOR)


def _finisher(lib: ctypes.CDLL) -> None:
    """The thread that completes ops: never the engine's (which must not copy outputs or
    run TensorFlow's continuation), never TensorFlow's inter-op threads."""
    while True:
        call = _finished.get()
        try:
            _finish(lib, call)
        except Exception:  # noqa: BLE001 - one op's failure must not stop the others
            _log.exception("ringplug: could not complete a graph collective")


def _callbacks(lib: ctypes.CDLL) -> tuple[Any, Any, Any]:
    def create(construction: int) -> int:
        key, status = ctypes.c_int64(), lib.TF_NewStatus()
        try:
            lib.TF_OpKernelConstruction_GetAttrInt64(
                construction, b"key", ctypes.byref(key), status
            )
            return key.value if lib.TF_GetCode(status) == 0 else 0
        finally:
            lib.TF_DeleteStatus(status)

    def compute_async(kernel: int | None, context: int, done: int) -> None:
        call = _Call(context, done)
        try:
            submit = _submitters.get(kernel or 0)
            if submit is None:
                raise RuntimeError(
                    "this collective's graph was deleted in Python while TensorFlow still "
                    "runs it; keep the graph (or the tf.function) alive while it runs."
                )
            status = lib.TF_NewStatus()
            try:
                arrays = _arrays(lib, call, status)
            finally:
                lib.TF_DeleteStatus(status)
            call.started = submit(arrays)
        except Exception as exc:  # noqa: BLE001 - a callback must not raise into C
            call.failure = _failure(exc)
            _finished.put(call)
            return
        call.started.add_done_callback(lambda: _finished.put(call))

    def delete(kernel: int | None) -> None:
        pass  # the submitter stays: another kernel instance of the same node may use it

    return _CREATE(create), _COMPUTE_ASYNC(compute_async), _DELETE(delete)


def _register() -> None:
    _done_is_a_std_function()
    lib = ctypes.CDLL(os.path.join(tf.sysconfig.get_lib(), "libtensorflow_framework.so.2"))
    _bind(lib)
    status = lib.TF_NewStatus()
    try:
        builder = lib.TF_NewOpDefinitionBuilder(OP.encode())
        for attr in (b"Tin: list(type) >= 0", b"Tout: list(type) >= 0", b"key: int"):
            lib.TF_OpDefinitionBuilderAddAttr(builder, attr)
        lib.TF_OpDefinitionBuilderAddInput(builder, b"inputs: Tin")
        lib.TF_OpDefinitionBuilderAddOutput(builder, b"outputs: Tout")
        lib.TF_OpDefinitionBuilderSetIsStateful(builder, True)
        # Shapes are set in Python (`set_shape`); TensorFlow's own UnknownShape has the
        # shape function's C signature, so no Python runs while graphs are built.
        unknown = ctypes.cast(lib.TF_ShapeInferenceContextSetUnknownShape, ctypes.c_void_p)
        lib.TF_OpDefinitionBuilderSetShapeInferenceFunction(builder, unknown)
        lib.TF_RegisterOpDefinition(builder, status)  # frees the builder
        if lib.TF_GetCode(status) != 0:
            raise RuntimeError(lib.TF_Message(status).decode())
        callbacks = _callbacks(lib)
        kernel = lib.TF_NewAsyncKernelBuilder(OP.encode(), b"CPU", *callbacks)
        lib.TF_RegisterKernelBuilder(f"{OP}CPU".encode(), kernel, status)
        if lib.TF_GetCode(status) != 0:
            raise RuntimeError(lib.TF_Message(status).decode())
        _state["keep"] = (lib, callbacks)  # TensorFlow calls them for the process's life
    finally:
        lib.TF_DeleteStatus(status)
    threading.Thread(
        target=_finisher, args=(lib,), name="ringplug-tf-finisher", daemon=True
    ).start()


def available() -> bool:
    """Whether graph collectives run as the asynchronous op (registers it the first time)."""
    return register_once(
        _state,
        _lock,
        _register,
        f"graph collectives will hold one of TensorFlow's inter-op threads while they wait "
        f"({OP} could not be registered",
    )


def why_not() -> str | None:
    """Why the asynchronous op is not available (None when it is or was not tried)."""
    return _state.get("why")


def collective(
    submit: Submit, inputs: Sequence[Any], touts: Sequence[tf.DType], name: str
) -> list[Any]:
    """The op's outputs (dtypes `touts`): `submit(arrays)` starts the collective on the
    inputs' values each time the op runs, and the op finishes when it is done."""
    from tensorflow.python.framework import op_def_library  # how generated ops build

    key = next(_keys)
    with _lock:
        _submitters[key] = submit
        # A traced tf.function keeps its FuncGraph, a session its Graph.
        _held.setdefault(tf.compat.v1.get_default_graph(), []).append(submit)
    _, _, op, _ = op_def_library._apply_op_helper(
        OP, inputs=list(inputs), Tout=list(touts), key=key, name=name
    )
    return list(op.outputs)
