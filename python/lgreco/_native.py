"""liblgreco.so's comm-hook C ABI (plugin/hook/lgreco_hook.h) through ctypes.

ctypes releases the GIL during each foreign call, so a hook's worker thread can run the
engine while the training thread goes on with backward.
"""

import ctypes
import os

from . import LgrecoError, library_path

ABI_VERSION = 1
DONE, PASS_THROUGH, ERROR = 0, 1, -1
_MESSAGE_BYTES = 4096
_lib = None


def library():
    """The loaded library (once per process; the same file LD_PRELOAD would name)."""
    global _lib
    if _lib is None:
        path = library_path()
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_LOCAL | os.RTLD_NOW)
        except OSError as e:
            raise LgrecoError("cannot load %s: %s" % (path, e)) from e
        try:
            lib.lgreco_hook_abi_version.restype = ctypes.c_int
            lib.lgreco_hook_open.restype = ctypes.c_void_p
            lib.lgreco_hook_open.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                                             ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
            lib.lgreco_hook_allreduce_mean.restype = ctypes.c_int
            lib.lgreco_hook_allreduce_mean.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64,
                                                       ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int,
                                                       ctypes.c_char_p, ctypes.c_size_t]
            lib.lgreco_hook_summary.restype = ctypes.c_int
            lib.lgreco_hook_summary.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
            lib.lgreco_hook_counters.restype = ctypes.c_int
            lib.lgreco_hook_counters.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
            lib.lgreco_hook_close.restype = None
            lib.lgreco_hook_close.argtypes = [ctypes.c_void_p]
        except AttributeError as e:
            raise LgrecoError("%s has no comm-hook ABI (%s): a library of another lgreco version?" % (path, e)) from e
        version = lib.lgreco_hook_abi_version()
        if version != ABI_VERSION:
            raise LgrecoError("%s has comm-hook ABI %d; this package needs %d: reinstall lgreco" %
                              (path, version, ABI_VERSION))
        _lib = lib
    return _lib


class Session:
    """One engine over lgreco's socket fabric for a process group (collective open)."""

    def __init__(self, rank, world_size, host, port, layout_json):
        lib = library()
        message = ctypes.create_string_buffer(_MESSAGE_BYTES)
        handle = lib.lgreco_hook_open(rank, world_size, host.encode(), port, layout_json.encode(), message,
                                      _MESSAGE_BYTES)
        if not handle:
            raise LgrecoError("rank %d: cannot start lgreco's engine: %s" % (rank, message.value.decode(errors="replace")))
        self._lib, self._handle, self._message = lib, handle, message

    def allreduce_mean(self, bucket, step, pointer, count, dtype_code):
        """DONE or PASS_THROUGH; raises LgrecoError with the engine's message on ERROR."""
        rc = self._lib.lgreco_hook_allreduce_mean(self._handle, bucket, step, pointer, count, dtype_code,
                                                  self._message, _MESSAGE_BYTES)
        if rc == ERROR:
            raise LgrecoError(self._message.value.decode(errors="replace"))
        return rc

    def summary(self):
        text = ctypes.create_string_buffer(512)
        self._lib.lgreco_hook_summary(self._handle, text, 512)
        return text.value.decode(errors="replace")

    COUNTERS = ("calls", "compressed_calls", "passed_through", "uncompressed_bytes", "encoded_bytes",
                "wire_bytes_sent")

    def counters(self):
        values = (ctypes.c_uint64 * len(self.COUNTERS))()
        self._lib.lgreco_hook_counters(self._handle, values, len(self.COUNTERS))
        return dict(zip(self.COUNTERS, (int(v) for v in values)))

    def close(self):
        if self._handle:
            self._lib.lgreco_hook_close(self._handle)
            self._handle = None
