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

import ctypes
import io
import pickle
import sys
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

    Raises:
        SerializationError: The function or an argument cannot be pickled.
    """
    try:
        return dumps((func, args, kwargs))
    except Exception as exc:
        name = getattr(func, "__qualname__", repr(func))
        raise SerializationError(
            f"cannot pickle the function {name} or its arguments with cloudpickle: {exc}. "
            "Everything passed to a launch must be picklable (no open files, locks, sockets)."
        ) from exc
