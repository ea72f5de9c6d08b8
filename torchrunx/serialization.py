"""Pickling of the user's function, arguments and results, with zero-copy tensors.

cloudpickle with pickle protocol 5: dense CPU tensors are written as out-of-band buffers (their
raw bytes, no copy) instead of through ``torch.save``, so a 400 MB tensor costs one socket
transfer and no (de)serialisation pass. The result is a list of buffers: the pickle stream
first, then one buffer per tensor; :class:`torchrunx.wire.records.Connection` sends them as the
parts of one frame.

A tensor's bytes are exposed through :mod:`ctypes` over its data pointer, not through
``Tensor.numpy()``: torch does not install numpy, and torchrunx does not depend on it.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import linecache
import pickle
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cloudpickle

from torchrunx.errors import SerializationError

if TYPE_CHECKING:
    from collections.abc import Callable


def _rebuild_tensor(buffer: Any, dtype_name: str, shape: tuple[int, ...]) -> Any:  # noqa: ANN401
    import torch  # noqa: PLC0415 (only when a tensor is being rebuilt)

    dtype = getattr(torch, dtype_name)
    if len(memoryview(buffer)) == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def _raw_bytes(tensor: Any) -> ctypes.Array[ctypes.c_ubyte] | bytes:  # noqa: ANN401 (a torch.Tensor)
    """The bytes of a contiguous CPU tensor, without a copy; they keep the tensor alive."""
    size = int(tensor.numel() * tensor.element_size())
    if size == 0:
        return b""
    raw = (ctypes.c_ubyte * size).from_address(int(tensor.data_ptr()))
    raw.owner = tensor  # type: ignore[attr-defined]  # the memory's owner lives as long as raw
    return raw


def _tensor_reduction(obj: Any) -> tuple[Any, ...] | None:  # noqa: ANN401
    torch = sys.modules.get("torch")
    if torch is None or type(obj) is not torch.Tensor:
        return None
    tensor = obj
    plain = (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
    )
    if not plain:
        return None
    raw = _raw_bytes(tensor.contiguous())
    dtype_name = str(tensor.dtype).removeprefix("torch.")
    return (_rebuild_tensor, (pickle.PickleBuffer(raw), dtype_name, tuple(tensor.shape)))


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle ships no types
    def reducer_override(self, obj: Any) -> Any:  # noqa: ANN401 (pickle's hook signature)
        reduction = _tensor_reduction(obj)
        if reduction is not None:
            return reduction
        return super().reducer_override(obj)


def dumps(obj: object) -> list[memoryview]:
    """Pickle ``obj``; the first buffer is the pickle stream, the others are tensor data.

    Raises:
        Exception: Whatever pickling raises for an object that cannot be pickled.
    """
    stream = io.BytesIO()
    buffers: list[pickle.PickleBuffer] = []
    _Pickler(stream, protocol=5, buffer_callback=buffers.append).dump(obj)
    return [stream.getbuffer(), *(buffer.raw() for buffer in buffers)]


def loads(parts: list[bytearray]) -> Any:  # noqa: ANN401 (whatever was pickled)
    """Rebuild an object from the buffers made by :func:`dumps` (tensors share their memory)."""
    return pickle.loads(parts[0], buffers=parts[1:])  # noqa: S301 (authenticated peer)


def dumps_call(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[memoryview]:
    """Pickle ``func(*args, **kwargs)`` for the workers, with a clear error if it cannot be.

    For a function of the launching script (``__main__``), the script's path and text travel
    with it (:func:`main_source`): cloudpickle writes the code of functions pickled by value
    without their file, and the worker gives it back (:func:`load_call`), so pdb, tracebacks
    and stacks in the workers show the script's lines, also on hosts where the script is not.

    Raises:
        SerializationError: The function or an argument cannot be pickled.
    """
    try:
        by_value = getattr(func, "__module__", None) == "__main__"  # else its file is importable
        return dumps((func, args, kwargs, main_source() if by_value else None))
    except Exception as exc:
        name = getattr(func, "__qualname__", repr(func))
        raise SerializationError(
            f"cannot pickle the function {name} or its arguments with cloudpickle: {exc}. "
            "Everything passed to a launch must be picklable (no open files, locks, sockets)."
        ) from exc


_DYNAMIC_CODE = "<dynamic-code>"
"""The file name cloudpickle gives the code of functions it pickles by value."""
_MAX_SOURCE_BYTES = 4 << 20


def main_source() -> tuple[str, str] | None:
    """The launching script's path and text, if it is a file of reasonable size (else None)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not isinstance(path, str):
        return None
    try:
        with Path(path).open("rb") as file:
            data = file.read(_MAX_SOURCE_BYTES + 1)
    except OSError:
        return None
    if len(data) > _MAX_SOURCE_BYTES:
        return None
    return str(Path(path).absolute()), data.decode("utf-8", errors="replace")


def load_call(
    payload: list[bytearray],
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """Unpickle a call made by :func:`dumps_call`; its by-value code gets the script's file back.

    The script's text is put in :mod:`linecache` under its path, so the lines show even where
    the file is not (another host) or has changed since.
    """
    func, args, kwargs, source = loads(payload)
    if source is not None:
        path, text = source
        lines = text.splitlines(keepends=True)
        linecache.cache[path] = (len(text), None, lines, path)  # mtime None: kept as it is
        _give_file(func, path)
        for value in list(getattr(func, "__globals__", {}).values()):
            _give_file(value, path)
    return func, args, kwargs


def _give_file(obj: object, path: str) -> None:
    code = getattr(obj, "__code__", None)
    if isinstance(code, types.CodeType) and code.co_filename == _DYNAMIC_CODE:
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            obj.__code__ = _with_file(code, path)  # type: ignore[attr-defined]


def _with_file(code: types.CodeType, path: str) -> types.CodeType:
    consts = tuple(
        _with_file(c, path) if isinstance(c, types.CodeType) else c for c in code.co_consts
    )
    if code.co_filename != _DYNAMIC_CODE:
        return code.replace(co_consts=consts)
    return code.replace(co_filename=path, co_consts=consts)
