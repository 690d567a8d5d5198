"""The few CUDA driver calls NCCL groups need, through :mod:`ctypes` on ``libcuda.so.1``.

Streams and events order NCCL's work against the caller's stream and tell the
watchdog when work completed; the pointer query finds the device of a buffer
that says only its address (``__cuda_array_interface__``); the copies serve the
opt-in host round trip. The driver API comes with every NVIDIA driver, so
nothing else from CUDA is needed. ``$FERRO_CUDA_DRIVER_LIBRARY`` names another
library (tests use a stub).

Contexts: ferro uses each device's primary context, the one the CUDA runtime
(PyTorch, CuPy) uses, so streams and pointers are shared with them.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Mapping
from typing import Any

from ferro import environment
from ferro.errors import BackendUnavailableError, CudaError

__all__ = ["DRIVER_ENV", "CudaDriver", "load_driver", "require_gpu"]

DRIVER_ENV = "FERRO_CUDA_DRIVER_LIBRARY"
DRIVER_SONAME = "libcuda.so.1"

SUCCESS = 0
ERROR_NOT_READY = 600
_NO_GPU_CODES = {100: "no CUDA-capable GPU is visible (CUDA_VISIBLE_DEVICES?)",
                 34: "libcuda is the toolkit's stub, not a driver", 35: "the NVIDIA driver is too old"}
POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
EVENT_DISABLE_TIMING = 2
STREAM_NON_BLOCKING = 1

_R = ctypes.c_int
_Handle = ctypes.c_void_p
_DevPtr = ctypes.c_uint64

#: name -> (return type, argument types), as cuda.h declares them (the _v2 entry points where they exist).
PROTOTYPES: Mapping[str, tuple[Any, tuple[Any, ...]]] = {
    "cuInit": (_R, (ctypes.c_uint,)),
    "cuDriverGetVersion": (_R, (ctypes.POINTER(ctypes.c_int),)),
    "cuDeviceGetCount": (_R, (ctypes.POINTER(ctypes.c_int),)),
    "cuDeviceGet": (_R, (ctypes.POINTER(ctypes.c_int), ctypes.c_int)),
    "cuDeviceGetPCIBusId": (_R, (ctypes.c_char_p, ctypes.c_int, ctypes.c_int)),
    "cuDevicePrimaryCtxRetain": (_R, (ctypes.POINTER(_Handle), ctypes.c_int)),
    "cuCtxGetCurrent": (_R, (ctypes.POINTER(_Handle),)),
    "cuCtxSetCurrent": (_R, (_Handle,)),
    "cuCtxGetDevice": (_R, (ctypes.POINTER(ctypes.c_int),)),
    "cuStreamCreate": (_R, (ctypes.POINTER(_Handle), ctypes.c_uint)),
    "cuStreamDestroy_v2": (_R, (_Handle,)),
    "cuStreamSynchronize": (_R, (_Handle,)),
    "cuStreamWaitEvent": (_R, (_Handle, _Handle, ctypes.c_uint)),
    "cuEventCreate": (_R, (ctypes.POINTER(_Handle), ctypes.c_uint)),
    "cuEventDestroy_v2": (_R, (_Handle,)),
    "cuEventRecord": (_R, (_Handle, _Handle)),
    "cuEventQuery": (_R, (_Handle,)),
    "cuPointerGetAttribute": (_R, (ctypes.c_void_p, ctypes.c_int, _DevPtr)),
    "cuMemAlloc_v2": (_R, (ctypes.POINTER(_DevPtr), ctypes.c_size_t)),
    "cuMemFree_v2": (_R, (_DevPtr,)),
    "cuMemcpyDtoH_v2": (_R, (ctypes.c_void_p, _DevPtr, ctypes.c_size_t)),
    "cuMemcpyHtoD_v2": (_R, (_DevPtr, ctypes.c_void_p, ctypes.c_size_t)),
    "cuGetErrorName": (_R, (_R, ctypes.POINTER(ctypes.c_char_p))),
}


class CudaDriver:
    """The loaded driver library, its calls checked: each failure raises :class:`CudaError` naming the call."""

    def __init__(self, handle: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._fn: dict[str, Any] = {}
        for name, (restype, argtypes) in PROTOTYPES.items():
            function = getattr(handle, name)
            function.restype, function.argtypes = restype, argtypes
            self._fn[name] = function
        self._contexts: dict[int, int] = {}

    def call(self, name: str, *args: Any) -> int:
        """Call ``name``; raise :class:`CudaError` unless it succeeded (or is still running: NOT_READY)."""
        code = self._fn[name](*args)
        if code not in (SUCCESS, ERROR_NOT_READY):
            raise CudaError(f"CUDA {name} failed: {self.error_name(code)}", code)
        return int(code)

    def error_name(self, code: int) -> str:
        """Return the driver's name for ``code`` (``CUDA_ERROR_...``)."""
        text = ctypes.c_char_p()
        if self._fn["cuGetErrorName"](code, ctypes.byref(text)) == SUCCESS and text.value:
            return f"{text.value.decode()} ({code})"
        return f"CUresult {code}"

    def device_count(self) -> int:
        """Initialise the driver and return how many GPUs it sees (0 where it sees none)."""
        code = self._fn["cuInit"](0)
        if code in _NO_GPU_CODES:
            return 0
        if code != SUCCESS:
            raise CudaError(f"CUDA cuInit failed: {self.error_name(code)}", code)
        count = ctypes.c_int()
        self.call("cuDeviceGetCount", ctypes.byref(count))
        return count.value

    def pci_bus_id(self, device: int) -> str:
        """Return the PCI bus id of ``device`` (what tells two ranks they share a GPU)."""
        text = ctypes.create_string_buffer(64)
        self.call("cuDeviceGetPCIBusId", text, len(text), device)
        return text.value.decode()

    def current_device(self) -> int | None:
        """Return the device of the calling thread's current context, or None when it has none."""
        context = _Handle()
        self.call("cuCtxGetCurrent", ctypes.byref(context))
        if not context.value:
            return None
        device = ctypes.c_int()
        self.call("cuCtxGetDevice", ctypes.byref(device))
        return device.value

    def use_device(self, device: int) -> None:
        """Make ``device``'s primary context current on the calling thread (retained once per device)."""
        context = self._contexts.get(device)
        if context is None:
            handle = _Handle()
            self.call("cuDevicePrimaryCtxRetain", ctypes.byref(handle), device)
            context = self._contexts.setdefault(device, handle.value or 0)
        current = _Handle()
        self.call("cuCtxGetCurrent", ctypes.byref(current))
        if current.value != context:
            self.call("cuCtxSetCurrent", context)

    def pointer_device(self, pointer: int) -> int:
        """Return the device that holds the memory at ``pointer``."""
        device = ctypes.c_int()
        self.call("cuPointerGetAttribute", ctypes.byref(device), POINTER_ATTRIBUTE_DEVICE_ORDINAL, pointer)
        return device.value

    def new_stream(self) -> int:
        """Create a stream that does not synchronise with the legacy default stream."""
        stream = _Handle()
        self.call("cuStreamCreate", ctypes.byref(stream), STREAM_NON_BLOCKING)
        return stream.value or 0

    def new_event(self) -> int:
        """Create an event without timing (the cheap kind)."""
        event = _Handle()
        self.call("cuEventCreate", ctypes.byref(event), EVENT_DISABLE_TIMING)
        return event.value or 0

    def record(self, event: int, stream: int) -> None:
        """Record ``event`` on ``stream``."""
        self.call("cuEventRecord", event, stream)

    def stream_wait(self, stream: int, event: int) -> None:
        """Make ``stream``'s later work wait for ``event`` (the host does not wait)."""
        self.call("cuStreamWaitEvent", stream, event, 0)

    def event_done(self, event: int) -> bool:
        """Whether the work before ``event`` has completed."""
        return self.call("cuEventQuery", event) == SUCCESS

    def synchronize(self, stream: int) -> None:
        """Block the host until ``stream``'s work is done."""
        self.call("cuStreamSynchronize", stream)

    def destroy_event(self, event: int) -> None:
        """Release ``event``."""
        self._fn["cuEventDestroy_v2"](event)

    def destroy_stream(self, stream: int) -> None:
        """Release ``stream``."""
        self._fn["cuStreamDestroy_v2"](stream)

    def alloc(self, nbytes: int) -> int:
        """Allocate device memory on the current context."""
        pointer = _DevPtr()
        self.call("cuMemAlloc_v2", ctypes.byref(pointer), nbytes)
        return pointer.value

    def free(self, pointer: int) -> None:
        """Free memory from :meth:`alloc`."""
        self._fn["cuMemFree_v2"](pointer)

    def to_host(self, host: int, device: int, nbytes: int) -> None:
        """Copy ``nbytes`` from device to host memory (synchronous)."""
        self.call("cuMemcpyDtoH_v2", host, device, nbytes)

    def to_device(self, device: int, host: int, nbytes: int) -> None:
        """Copy ``nbytes`` from host to device memory (synchronous)."""
        self.call("cuMemcpyHtoD_v2", device, host, nbytes)


@functools.cache  # loaded once per process, like an import
def load_driver() -> CudaDriver:
    """Load the CUDA driver library (``$FERRO_CUDA_DRIVER_LIBRARY``, else ``libcuda.so.1``).

    Raises:
        BackendUnavailableError: No NVIDIA driver is installed.

    """
    path = environment.get(DRIVER_ENV) or DRIVER_SONAME
    try:
        handle = ctypes.CDLL(path)
    except OSError as exc:
        raise BackendUnavailableError(
            f"no NVIDIA driver: {path} cannot be loaded ({exc}); NCCL groups need a GPU with its driver "
            f"installed") from None
    try:
        return CudaDriver(handle, path)
    except AttributeError as exc:
        raise BackendUnavailableError(f"{path} is not a CUDA driver library: {exc}") from None


def require_gpu() -> CudaDriver:
    """Return the driver once it is known to see at least one GPU.

    Raises:
        BackendUnavailableError: No driver, or no GPU visible to it (the message says which).

    """
    driver = load_driver()
    code = driver._fn["cuInit"](0)
    if code != SUCCESS:
        why = _NO_GPU_CODES.get(code, driver.error_name(code))
        raise BackendUnavailableError(f"no usable GPU: the CUDA driver ({driver.path}) says {why}")
    if driver.device_count() == 0:
        raise BackendUnavailableError(f"no GPU: the CUDA driver ({driver.path}) sees no device "
                                      f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return driver
