"""The hand-written ctypes ABI of libucp/libucs that :mod:`kvtransport_ucx._ucp` binds: constants, struct
layouts, the two error types, and the typed function prototypes (:class:`UcpLib`).

The layouts were checked against the headers of the versions in ``_ucp_lib.VERIFIED_VERSIONS`` (the version gate
that refuses others lives in :mod:`kvtransport_ucx._ucp_lib`; tests/backends/test_ucp_binding.py::test_struct_layouts
compiles a probe against the installed headers). Nothing here loads a library: :class:`UcpLib` is built by
``_ucp_lib.load_library()`` from the handles it found.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

# --------------------------------------------------------------------------- constants
UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_BUSY = -15
UCS_ERR_LAST = -100

UCS_THREAD_MODE_SINGLE = 0
UCS_THREAD_MODE_MULTI = 2

UCS_MEMORY_TYPE_HOST = 0
UCS_MEMORY_TYPE_CUDA = 1

UCP_PARAM_FIELD_FEATURES = 1 << 0
UCP_PARAM_FIELD_NAME = 1 << 8
UCP_FEATURE_RMA = 1 << 1
UCP_FEATURE_AMO64 = 1 << 3
UCP_FEATURE_WAKEUP = 1 << 4

UCP_WORKER_PARAM_FIELD_THREAD_MODE = 1 << 0

UCP_EP_PARAM_FIELD_REMOTE_ADDRESS = 1 << 0
UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE = 1 << 1
UCP_ERR_HANDLING_MODE_NONE = 0
UCP_ERR_HANDLING_MODE_PEER = 1

UCP_MEM_MAP_PARAM_FIELD_ADDRESS = 1 << 0
UCP_MEM_MAP_PARAM_FIELD_LENGTH = 1 << 1
UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE = 1 << 4

UCP_OP_ATTR_FIELD_DATATYPE = 1 << 3
UCP_OP_ATTR_FIELD_FLAGS = 1 << 4

UCP_EP_ATTR_FIELD_TRANSPORTS = 1 << 3

UCP_ATOMIC_OP_ADD = 0
UCP_DATATYPE_CONTIG = 0
UCP_DATATYPE_SHIFT = 3


def dt_make_contig(elem_size: int) -> int:
    return (elem_size << UCP_DATATYPE_SHIFT) | UCP_DATATYPE_CONTIG


# --------------------------------------------------------------------------- structs
c_u64 = ctypes.c_uint64
c_vp = ctypes.c_void_p
#: ``ucs_status_t`` is a *packed* enum: one signed byte, not an int.
c_status = ctypes.c_int8


class UcpParams(ctypes.Structure):
    """``ucp_params_t``."""

    _fields_ = [
        ("field_mask", c_u64),
        ("features", c_u64),
        ("request_size", ctypes.c_size_t),
        ("request_init", c_vp),
        ("request_cleanup", c_vp),
        ("tag_sender_mask", c_u64),
        ("mt_workers_shared", ctypes.c_int),
        ("estimated_num_eps", ctypes.c_size_t),
        ("estimated_num_ppn", ctypes.c_size_t),
        ("name", ctypes.c_char_p),
        ("node_local_id", ctypes.c_size_t),
    ]


class _UcsCpuSet(ctypes.Structure):
    """``ucs_cpu_set_t`` (UCS_CPU_SETSIZE == 1024 bits)."""

    _fields_ = [("ucs_bits", ctypes.c_ulong * (1024 // (8 * ctypes.sizeof(ctypes.c_ulong))))]


class UcpWorkerParams(ctypes.Structure):
    """``ucp_worker_params_t``."""

    _fields_ = [
        ("field_mask", c_u64),
        ("thread_mode", ctypes.c_int),
        ("cpu_mask", _UcsCpuSet),
        ("events", ctypes.c_uint),
        ("user_data", c_vp),
        ("event_fd", ctypes.c_int),
        ("flags", c_u64),
        ("name", ctypes.c_char_p),
        ("am_alignment", ctypes.c_size_t),
        ("client_id", c_u64),
    ]


class _UcpErrHandler(ctypes.Structure):
    """``ucp_err_handler_t``."""

    _fields_ = [("cb", c_vp), ("arg", c_vp)]


class _UcsSockAddr(ctypes.Structure):
    """``ucs_sock_addr_t``."""

    _fields_ = [("addr", c_vp), ("addrlen", ctypes.c_uint32)]


class UcpEpParams(ctypes.Structure):
    """``ucp_ep_params_t``."""

    _fields_ = [
        ("field_mask", c_u64),
        ("address", c_vp),
        ("err_mode", ctypes.c_int),
        ("err_handler", _UcpErrHandler),
        ("user_data", c_vp),
        ("flags", ctypes.c_uint),
        ("sockaddr", _UcsSockAddr),
        ("conn_request", c_vp),
        ("name", ctypes.c_char_p),
        ("local_sockaddr", _UcsSockAddr),
    ]


class UcpMemMapParams(ctypes.Structure):
    """``ucp_mem_map_params_t``."""

    _fields_ = [
        ("field_mask", c_u64),
        ("address", c_vp),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("exported_memh_buffer", c_vp),
    ]


class UcpRequestParam(ctypes.Structure):
    """``ucp_request_param_t`` (1.22 layout; 1.21 has the same prefix, and we
    only ever set fields of that prefix)."""

    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", c_vp),
        ("cb", c_vp),
        ("datatype", c_u64),
        ("user_data", c_vp),
        ("reply_buffer", c_vp),
        ("memory_type", ctypes.c_int),
        ("recv_info", c_vp),
        ("memh", c_vp),
        ("remote_datatype", c_u64),
        ("remote", c_vp),
        ("remote_count", ctypes.c_size_t),
        ("_reserve", ctypes.c_uint64 * 8),  # slack: never read by us
    ]


class UcpTransportEntry(ctypes.Structure):
    """``ucp_transport_entry_t``."""

    _fields_ = [("transport_name", ctypes.c_char_p), ("device_name", ctypes.c_char_p)]


class _UcpTransports(ctypes.Structure):
    """``ucp_transports_t``."""

    _fields_ = [
        ("entries", ctypes.POINTER(UcpTransportEntry)),
        ("num_entries", ctypes.c_uint),
        ("entry_size", ctypes.c_size_t),
    ]


class _SockaddrStorage(ctypes.Structure):
    """``struct sockaddr_storage`` (128 bytes, 8-byte aligned on Linux)."""

    _fields_ = [("_data", ctypes.c_uint64 * 16)]


class UcpEpAttr(ctypes.Structure):
    """``ucp_ep_attr_t``."""

    _fields_ = [
        ("field_mask", c_u64),
        ("name", ctypes.c_char * 32),
        ("local_sockaddr", _SockaddrStorage),
        ("remote_sockaddr", _SockaddrStorage),
        ("transports", _UcpTransports),
        ("user_data", c_vp),
    ]


#: Offsets/sizes checked by the layout test against the installed headers.
STRUCTS: dict[str, type[ctypes.Structure]] = {
    "ucp_params_t": UcpParams,
    "ucp_worker_params_t": UcpWorkerParams,
    "ucp_ep_params_t": UcpEpParams,
    "ucp_mem_map_params_t": UcpMemMapParams,
    "ucp_request_param_t": UcpRequestParam,
    "ucp_transport_entry_t": UcpTransportEntry,
    "ucp_transports_t": _UcpTransports,
    "ucp_ep_attr_t": UcpEpAttr,
}


# --------------------------------------------------------------------------- errors
class UcpError(RuntimeError):
    """A UCP call failed.  ``status`` is the ``ucs_status_t`` (negative) or None."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class UcpUnavailableError(ImportError):
    """libucp cannot be loaded (not installed, or an unverified version)."""



class UcpLib:
    """The loaded libraries and typed function pointers."""

    def __init__(self, ucp: ctypes.CDLL, ucs: ctypes.CDLL, path: str) -> None:
        self.ucp = ucp
        self.ucs = ucs
        self.path = path
        P = ctypes.POINTER
        st = c_status

        def fn(lib: ctypes.CDLL, name: str, restype: Any, *argtypes: Any) -> Any:
            f = getattr(lib, name)
            f.restype = restype
            f.argtypes = list(argtypes)
            return f

        self.ucs_status_string = fn(ucs, "ucs_status_string", ctypes.c_char_p, st)
        self.get_version = fn(ucp, "ucp_get_version", None, P(ctypes.c_uint), P(ctypes.c_uint), P(ctypes.c_uint))
        self.config_read = fn(ucp, "ucp_config_read", st, ctypes.c_char_p, ctypes.c_char_p, P(c_vp))
        self.config_modify = fn(ucp, "ucp_config_modify", st, c_vp, ctypes.c_char_p, ctypes.c_char_p)
        self.config_release = fn(ucp, "ucp_config_release", None, c_vp)
        self.init_version = fn(ucp, "ucp_init_version", st, ctypes.c_uint, ctypes.c_uint, P(UcpParams), c_vp, P(c_vp))
        self.cleanup = fn(ucp, "ucp_cleanup", None, c_vp)
        self.worker_create = fn(ucp, "ucp_worker_create", st, c_vp, P(UcpWorkerParams), P(c_vp))
        self.worker_destroy = fn(ucp, "ucp_worker_destroy", None, c_vp)
        self.worker_get_address = fn(ucp, "ucp_worker_get_address", st, c_vp, P(c_vp), P(ctypes.c_size_t))
        self.worker_release_address = fn(ucp, "ucp_worker_release_address", None, c_vp, c_vp)
        self.worker_progress = fn(ucp, "ucp_worker_progress", ctypes.c_uint, c_vp)
        self.worker_get_efd = fn(ucp, "ucp_worker_get_efd", st, c_vp, P(ctypes.c_int))
        self.worker_arm = fn(ucp, "ucp_worker_arm", st, c_vp)
        self.worker_signal = fn(ucp, "ucp_worker_signal", st, c_vp)
        self.mem_map = fn(ucp, "ucp_mem_map", st, c_vp, P(UcpMemMapParams), P(c_vp))
        self.mem_unmap = fn(ucp, "ucp_mem_unmap", st, c_vp, c_vp)
        self.rkey_pack = fn(ucp, "ucp_rkey_pack", st, c_vp, c_vp, P(c_vp), P(ctypes.c_size_t))
        self.rkey_buffer_release = fn(ucp, "ucp_rkey_buffer_release", None, c_vp)
        self.ep_create = fn(ucp, "ucp_ep_create", st, c_vp, P(UcpEpParams), P(c_vp))
        self.ep_close_nbx = fn(ucp, "ucp_ep_close_nbx", c_vp, c_vp, P(UcpRequestParam))
        self.ep_flush_nbx = fn(ucp, "ucp_ep_flush_nbx", c_vp, c_vp, P(UcpRequestParam))
        self.ep_print_info = fn(ucp, "ucp_ep_print_info", None, c_vp, c_vp)
        self.ep_query = fn(ucp, "ucp_ep_query", st, c_vp, P(UcpEpAttr))
        self.ep_rkey_unpack = fn(ucp, "ucp_ep_rkey_unpack", st, c_vp, c_vp, P(c_vp))
        self.rkey_destroy = fn(ucp, "ucp_rkey_destroy", None, c_vp)
        self.put_nbx = fn(ucp, "ucp_put_nbx", c_vp, c_vp, c_vp, ctypes.c_size_t, c_u64, c_vp, P(UcpRequestParam))
        self.atomic_op_nbx = fn(
            ucp,
            "ucp_atomic_op_nbx",
            c_vp,
            c_vp,
            ctypes.c_int,
            c_vp,
            ctypes.c_size_t,
            c_u64,
            c_vp,
            P(UcpRequestParam),
        )
        self.request_check_status = fn(ucp, "ucp_request_check_status", st, c_vp)
        self.request_free = fn(ucp, "ucp_request_free", None, c_vp)

        major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        self.get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
        self.version: tuple[int, int, int] = (major.value, minor.value, release.value)

        libc_name = ctypes.util.find_library("c") or "libc.so.6"
        self.libc = ctypes.CDLL(libc_name)
        self.open_memstream = fn(self.libc, "open_memstream", c_vp, P(c_vp), P(ctypes.c_size_t))
        self.fclose = fn(self.libc, "fclose", ctypes.c_int, c_vp)
        self.free = fn(self.libc, "free", None, c_vp)

    def status_string(self, status: int) -> str:
        s = self.ucs_status_string(status)
        return s.decode() if s else f"ucs_status {status}"

    def check(self, status: int, what: str) -> None:
        if status != UCS_OK:
            raise UcpError(f"{what} failed: {self.status_string(status)} ({status})", status)
