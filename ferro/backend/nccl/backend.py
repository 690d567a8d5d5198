"""The NCCL process group (``backend="nccl"``) and the TCP+NCCL hybrid (``backend="hybrid"``).

* :class:`NcclBackend` moves GPU memory only, like ``torch.distributed``'s
  NCCL group: collectives and point-to-point on CUDA buffers, the barrier on
  the GPU. Host arrays are refused with a message pointing at ``"hybrid"``.
* :class:`HybridBackend` is a TCP group (host arrays, objects, barrier and
  point-to-point of host buffers, all on ferro's compiled TCP transport) that
  also holds an NCCL communicator: collectives and point-to-point on GPU
  buffers go to NCCL, so one group serves a training loop's CPU and GPU
  traffic, as torch's ``"cpu:gloo,cuda:nccl"`` does.

Both check for a GPU, its driver and libnccl before any rendezvous, so a
machine without them gets :class:`~ferro.BackendUnavailableError` at once.
Sub-groups split the NCCL communicator (``ncclCommSplit``), which is
collective: every rank of the parent calls :func:`ferro.new_group`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from ferro.backend.base import Support
from ferro.backend.joined import JoinSpec, StoreBackend
from ferro.backend.nccl.communicator import Communicator
from ferro.backend.nccl.cuda import require_gpu
from ferro.backend.nccl.library import load_library
from ferro.backend.nccl.types import NCCL_DTYPES
from ferro.backend.tcp import TcpBackend
from ferro.errors import BackendUnavailableError, DistributedError, InvalidBufferError
from ferro.rendezvous.settings import default_timeout, validate_rank_and_size
from ferro.rendezvous.store import Store

__all__ = ["HybridBackend", "NcclBackend", "require_nccl"]


def require_nccl(backend: str) -> None:
    """Check that this process can run NCCL: a driver, a GPU, and libnccl.

    Raises:
        BackendUnavailableError: Naming everything missing and how to get it.

    """
    missing = []
    for check in (require_gpu, load_library):
        try:
            check()
        except BackendUnavailableError as exc:
            missing.append(str(exc))
    if missing:
        raise BackendUnavailableError(f"backend {backend!r} cannot run in this process: {'; '.join(missing)}. "
                                      f"On a machine without a GPU use backend='tcp' (or 'auto')")


def _split_left_out(group: Any, comm: Communicator | None, timeout: float | None) -> None:
    """Take part in a split as a rank the new sub-group leaves out (NCCL_SPLIT_NOCOLOR), for both NCCL groups."""
    group._usable("new_group")
    assert comm is not None
    comm.split(None, group.timeout if timeout is None else default_timeout(timeout))


class NcclBackend(StoreBackend):
    """A process group whose ranks talk through NCCL, one GPU each.

    Rank 0 serves the rendezvous store unless one is given; NCCL's unique id
    travels through it.

    Args:
        rank: This process's rank.
        world_size: Number of ranks.
        master_addr: Address of the store (rank 0's host).
        master_port: Port of the store.
        timeout: Default seconds for set-up and for each operation (default ``$FERRO_TIMEOUT`` or 60).
        secret: The job secret (default ``$FERRO_SECRET``).
        store: An existing store to rendezvous through.
        close_store: Close a given ``store`` with the group.
        device_id: This rank's GPU (default: the current device, else ``LOCAL_RANK``).

    Raises:
        BackendUnavailableError: No GPU, driver or libnccl.
        ConfigurationError: Two ranks on one GPU (named).
        DistributedTimeoutError: Ranks that never arrived (named).

    Example::

        # under `ferro run --nproc-per-node 2 train.py`, one GPU per rank
        ferro.init_process_group(backend="nccl")
        x = torch.ones(4, device="cuda")
        ferro.allreduce(x)            # x == 2 on both ranks, on the current stream

    """

    SUPPORT: ClassVar[Support] = Support(
        devices="CUDA GPUs, one per rank (torch tensors, CuPy arrays)",
        dtypes=f"NCCL's: {', '.join(NCCL_DTYPES)} (each from the NCCL version that has it); complex as pairs "
               "of reals; no bitwise ops",
        engine="every collective, on the GPU (NCCL)", generic="none",
        asynchronous="yes, on CUDA streams",
        point_to_point="yes, tag 0 only (NCCL matches messages in order)",
        receive_any="no: NCCL has no such receive",
        sub_groups="yes (ncclCommSplit)")

    store_namespace = "nccl"
    host_memory = False
    splits_collectively = True

    def __init__(self, rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500, *,
                 timeout: float | None = None, secret: bytes | str | None = None, store: Store | None = None,
                 close_store: bool = False, device_id: int | None = None) -> None:
        validate_rank_and_size(rank, world_size)
        require_nccl("nccl")
        self._comm: Communicator | None = None
        self._join(rank, world_size, master_addr, master_port, timeout, secret, store, close_store,
                   lambda: self._attach(device_id))

    def _attach(self, device_id: int | None) -> None:
        self._links = {}
        self._comm = Communicator.create(self._store, f"{self._prefix}/nccl", self._rank, self._world_size,
                                         self._timeout, self._deadline, device_id, self.mark_failed)

    @classmethod
    def join(cls, spec: JoinSpec) -> NcclBackend:
        """Join the job described by ``spec`` (the backend registry's entry point)."""
        return cls(spec.rank, spec.world_size, spec.master_addr, spec.master_port, timeout=spec.timeout,
                   secret=spec.secret, store=spec.store, close_store=spec.close_store, device_id=spec.device_id)

    @property
    def device_collectives(self) -> Communicator | None:
        """The group's NCCL communicator."""
        return self._comm

    def _host_refused(self, op: str) -> InvalidBufferError:
        return InvalidBufferError(
            f"rank {self._rank}: {op}: an NCCL group moves GPU memory only; for host arrays and objects use "
            f"backend='hybrid' (TCP for the host, NCCL for the GPU), or a TCP group beside this one")

    def send_tagged(self, buf: Any, dst: int, *, kind: int, fingerprint: int, timeout: float | None = None) -> None:
        """Refuse: host buffers do not travel on an NCCL group (see :meth:`_host_refused`)."""
        raise self._host_refused("send")

    def recv_tagged(self, buf: Any, src: int, *, kind: int, fingerprint: int, timeout: float | None = None) -> None:
        """Refuse: host buffers do not travel on an NCCL group."""
        raise self._host_refused("recv")

    def frames_waiting(self, sources: Sequence[int]) -> list[int]:
        """Refuse: NCCL has no receive from any source, and host messages do not travel here."""
        raise self._host_refused("recv from any source")

    def sendrecv_tagged(self, send_buf: Any, dst: int, recv_buf: Any, src: int, *, kind: int, fingerprint: int,
                        timeout: float | None = None) -> None:
        """Refuse: host buffers do not travel on an NCCL group."""
        raise self._host_refused("sendrecv")

    def barrier(self, *, timeout: float | None = None) -> None:
        """Block the host until every rank arrived: one int32 allreduced on the GPU."""
        self._usable("barrier")
        assert self._comm is not None
        self._comm.barrier(timeout)

    def split(self, ranks: Sequence[int], *, timeout: float | None = None) -> NcclBackend:
        """Split the communicator for ``ranks`` (``ncclCommSplit``; every rank of this group takes part)."""
        self._usable("new_group")
        assert self._comm is not None
        members = tuple(ranks)
        seconds = self._timeout if timeout is None else default_timeout(timeout)
        comm = self._comm.split(members, seconds)
        child = NcclBackend.__new__(NcclBackend)
        child._init_state(members.index(self._rank), len(members), self._store, False, self._split_prefix(members),
                          self._secret, seconds)
        child._links, child._comm = {}, comm
        return child

    def split_excluded(self, *, timeout: float | None = None) -> None:
        """Take part in ``ncclCommSplit`` as a rank left out of the new group."""
        _split_left_out(self, self._comm, timeout)

    def _release(self) -> None:
        if self._comm is not None:
            self._comm.close()


class HybridBackend(TcpBackend):
    """A TCP group that also holds an NCCL communicator for GPU buffers (see the module docstring).

    Takes :class:`~ferro.TcpBackend`'s arguments, plus ``device_id`` (this rank's
    GPU; default: the current device, else ``LOCAL_RANK``).

    Example::

        ferro.init_process_group(backend="hybrid")
        ferro.allreduce(torch.ones(4, device="cuda"))   # NCCL
        ferro.allreduce(numpy.ones(4))                  # TCP
        ferro.broadcast_object({"step": 3})             # TCP

    """

    SUPPORT: ClassVar[Support] = Support(
        devices="CPU (over TCP) and CUDA GPUs (over NCCL)",
        dtypes="CPU arrays as `tcp`; GPU tensors as `nccl`",
        engine_kind="compiled TCP for host buffers; NCCL for GPU tensors",
        receive_any="yes, for host buffers")

    store_namespace = "hybrid"
    splits_collectively = True
    _comm: Communicator | None = None

    def __init__(self, rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500, *,
                 timeout: float | None = None, secret: bytes | str | None = None, bind_addr: str | None = None,
                 store: Store | None = None, spin_us: float | None = None, close_store: bool = False,
                 device_id: int | None = None) -> None:
        validate_rank_and_size(rank, world_size)
        require_nccl("hybrid")
        super().__init__(rank, world_size, master_addr, master_port, timeout=timeout, secret=secret,
                         bind_addr=bind_addr, store=store, spin_us=spin_us, close_store=close_store)
        try:
            self._comm = Communicator.create(self._store, f"{self._prefix}/nccl", self._rank, self._world_size,
                                             self._timeout, self._deadline, device_id, self.mark_failed)
        except BaseException:
            self.close()
            raise

    @classmethod
    def join(cls, spec: JoinSpec) -> HybridBackend:
        """Join the job described by ``spec`` (the backend registry's entry point)."""
        return cls(spec.rank, spec.world_size, spec.master_addr, spec.master_port, timeout=spec.timeout,
                   secret=spec.secret, store=spec.store, bind_addr=spec.bind_addr, close_store=spec.close_store,
                   device_id=spec.device_id)

    @property
    def device_collectives(self) -> Communicator | None:
        """The group's NCCL communicator."""
        return self._comm

    def split(self, ranks: Sequence[int], *, timeout: float | None = None) -> HybridBackend:
        """Connect a TCP mesh among ``ranks`` and split the NCCL communicator for them."""
        child = super().split(ranks, timeout=timeout)
        assert isinstance(child, HybridBackend) and self._comm is not None
        try:
            child._comm = self._comm.split(tuple(ranks), child.timeout)
        except BaseException:
            child.close()
            raise
        return child

    def split_excluded(self, *, timeout: float | None = None) -> None:
        """Take part in ``ncclCommSplit`` as a rank left out of the new group (TCP needs nothing)."""
        _split_left_out(self, self._comm, timeout)

    def _release(self) -> None:
        try:
            if self._comm is not None:
                self._comm.close()
        except DistributedError:
            pass  # closing never raises for a lost peer; the TCP mesh still goes
        super()._release()
