"""ferro as a ``torch.distributed`` backend: torch's own DDP and FSDP over ferro's transports.

Where ferro is installed, ``import torch`` registers the backend name
``"ferro"`` for CPU tensors (through torch's ``torch.backends`` entry points;
see ``_ferro_torch_plugin``), and importing this module registers it too
(:func:`register` does it again, harmlessly). Then::

    torch.distributed.init_process_group("ferro")       # under `ferro run`, torchrun, Ray Train...
    model = torch.nn.parallel.DistributedDataParallel(model)

builds a ferro group (``backend="auto"``: shared memory when every rank shares
a host, hierarchical or TCP otherwise; ``$FERRO_BACKEND`` names one) through
torch's own rendezvous store, and hands torch a :class:`ProcessGroupFerro`
around it. ``torch.distributed.new_group(ranks, backend="ferro")`` builds
another. Every rank needs the job secret in ``$FERRO_SECRET`` (``ferro run``
sets it; under torchrun, export the same random string on every node).

Each torch call becomes one ferro collective per tensor, issued on the group's
worker (:mod:`ferro.collective.work`) in call order, straight into the caller's tensors
where torch's call has an output tensor of the right layout (no staging copy).
The returned :class:`FerroWork` completes its torch future on the worker, so
DDP's gradient buckets reduce while backward goes on. Errors are ferro's
exceptions, which are also the builtins torch users catch (``TimeoutError``,
``ConnectionError``, ``ValueError``).

What torch cannot route here, or ferro does not do, raises a clear error:
GPU tensors (use ``"nccl"``) and ``ReduceOp.AVG`` on integers.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from ferro import collective, environment
from ferro.backend import JoinSpec, join_backend
from ferro.backend.base import Backend
from ferro.collective.flight_recorder import include_torch_frames
from ferro.collective.hang_watch import start_hang_watch
from ferro.collective.process_group import BACKEND_ENV, backend_by_hosts
from ferro.collective.work import PendingCollective, worker_of
from ferro.errors import ConfigurationError, DistributedError, InvalidBufferError
from ferro.interop._peer_links import PeerLinks
from ferro.interop._torch_args import (
    as_list,
    copy_parts,
    even_splits,
    factor_value,
    flat_view,
    is_async,
    product,
    scaled,
    timeout_of,
    torch_reduce_op,
)
from ferro.interop._torch_store import TorchStore
from ferro.interop._torch_work import HANDLES, FerroWork
from ferro.interop.torch_comm_hooks import comm_hook
from ferro.rendezvous.settings import TIMEOUT_ENV, default_timeout
from ferro.types import ReduceOp

__all__ = ["BACKEND_NAME", "FerroWork", "ProcessGroupFerro", "comm_hook", "create_process_group", "group_timeout",
           "register"]

BACKEND_NAME = "ferro"
"""The backend name ``torch.distributed.init_process_group`` takes for ferro."""
#: The ferro backends a torch group can run on (host memory, ranks from torch).
HOST_BACKENDS = ("auto", "tcp", "shm", "hierarchical")

_RedOpType = dist.ReduceOp.RedOpType
_SUM = dist.ReduceOp.SUM
_AllreduceOptions = dist.AllreduceOptions


def register() -> None:
    """Register ``"ferro"`` with ``torch.distributed`` for CPU tensors (again: nothing happens).

    Example::

        ferro.interop.torch.register()
        torch.distributed.init_process_group("ferro")
    """
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True, devices=["cpu"])


def _store_address(store: Any) -> str | None:
    """Return the host of the TCPStore under torch's prefix stores, or None (a file or hash store)."""
    seen = 0
    while store is not None and seen < 8:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store, seen = getattr(store, "underlying_store", None), seen + 1
    return None


def group_timeout(given: datetime.timedelta) -> float:
    """Return the seconds a torch-made group waits: torch's ``timeout=``, or ``$FERRO_TIMEOUT`` where none was given.

    torch hands a backend its own default (30 minutes) when the user passed no
    ``timeout=``, so that value is read as "not given": ``$FERRO_TIMEOUT`` (the
    setting every ferro group reads) then applies, and without it torch's
    default stands, as it would for gloo.

    Raises:
        ConfigurationError: ``$FERRO_TIMEOUT`` is not a number of seconds in (0, one week].

    """
    if given == default_pg_timeout and environment.get(TIMEOUT_ENV):
        return default_timeout()
    return given.total_seconds()


def create_process_group(options: Any, backend_options: Any) -> ProcessGroupFerro:
    """Build a ferro group through torch's store; torch calls this for ``init_process_group("ferro")``.

    Args:
        options: torch's ``_DistributedBackendOptions`` (store, rank, size, timeout, group id).
        backend_options: torch's per-backend options (unused: ferro reads its settings from the environment).

    Returns:
        The process group torch hands to its callers.

    Raises:
        ConfigurationError: ``$FERRO_BACKEND`` names a backend torch groups cannot run on, or a setting is invalid.

    """
    rank, size = int(options.group_rank), int(options.group_size)
    seconds = group_timeout(options.timeout)
    chosen = environment.get(BACKEND_ENV) or "auto"
    if chosen not in HOST_BACKENDS:
        raise ConfigurationError(
            f"rank {rank}: torch's 'ferro' backend runs on {', '.join(HOST_BACKENDS)}; {BACKEND_ENV}={chosen!r} is "
            f"not one of them (for GPUs use torch's 'nccl'; under mpirun use ferro's own init_process_group('mpi'))")
    store = TorchStore(options.store, seconds)
    if chosen == "auto":
        chosen = backend_by_hosts(store, rank, size, seconds)
    master = _store_address(options.store)
    # Listen where the peers can reach us: the route towards the store's host, else loopback.
    bind_addr = None if master else environment.get("FERRO_BIND_ADDR", "127.0.0.1")
    spec = JoinSpec(rank, size, master or "127.0.0.1", timeout=seconds, store=store, bind_addr=bind_addr)
    group = join_backend(chosen, spec)
    include_torch_frames()  # call sites are the user's lines, not torch.distributed's
    start_hang_watch()  # dumps on SIGUSR1 and on request, as under ferro's own init_process_group
    try:
        # Point-to-point gets a TCP mesh of its own (see ferro.interop._peer_links for why).
        links = PeerLinks(join_backend("tcp", spec), seconds) if size > 1 else None
    except BaseException:
        group.close()
        raise
    return ProcessGroupFerro(group, str(options.group_id), links)


class ProcessGroupFerro(dist.ProcessGroup):
    """A ``torch.distributed.ProcessGroup`` whose collectives run on a ferro group.

    torch builds it for ``init_process_group("ferro")`` and
    ``new_group(backend="ferro")``; :attr:`ferro_group` is the ferro group
    underneath, for ferro's own calls. Method names and arguments are torch's
    (``allreduce(tensors, opts)`` and so on); each returns a :class:`FerroWork`.

    Args:
        group: The connected ferro group.
        name: torch's name for the group (for messages).

    Example::

        dist.init_process_group("ferro")
        pg = dist.distributed_c10d._get_default_group()
        pg.ferro_group          # e.g. <ShmBackend rank 0 of 2>

    """

    def __init__(self, group: Backend, name: str = "", links: PeerLinks | None = None) -> None:
        super().__init__(group.rank, group.world_size)
        self._ferro = group
        self._links = links
        self._torch_name = name
        self._torch_desc = ""
        self._coalescing: list[FerroWork] | None = None

    # torch keeps a group's name and description in its backends; this group has none, so it keeps its own.
    def getGroupName(self) -> str:  # noqa: N802 - torch's name, called from C++
        """Return torch's name for this group."""
        return self._torch_name

    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's name, called from C++
        """Record torch's name for this group."""
        self._torch_name = name

    def getGroupDesc(self) -> str:  # noqa: N802 - torch's name, called from C++
        """Return torch's description of this group."""
        return self._torch_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - torch's name, called from C++
        """Record torch's description of this group."""
        self._torch_desc = desc

    @property
    def ferro_group(self) -> Backend:
        """The ferro group this torch group runs on."""
        return self._ferro

    def getBackendName(self) -> str:  # noqa: N802 - torch's name, called from C++
        """Return ``"ferro"``."""
        return BACKEND_NAME

    def name(self) -> str:
        """Return ``"ferro"``."""
        return BACKEND_NAME

    def _work(self, what: str, issued: Sequence[Any], value: Any, finish: Callable[[], None] | None = None
              ) -> FerroWork:
        """Return the work of a call; ``issued`` is what ferro returned (handles of async calls, results of others)."""
        pendings = [handle for handle in issued if isinstance(handle, HANDLES)]
        work = FerroWork(f"{what} on rank {self._ferro.rank}", pendings, value, finish)
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    def _check_world_times(self, whole: Any, whole_name: str, part: Any, part_name: str, name: str) -> None:
        """Refuse a ``whole`` tensor that does not hold world-size times ``part``'s elements."""
        n = self._ferro.world_size
        if whole.numel() != part.numel() * n:
            raise InvalidBufferError(f"rank {self._ferro.rank}: {name}: the {whole_name} has {whole.numel()} elements; "
                                     f"it needs the {part_name}'s {part.numel()} times the world size {n}")

    def _queue(self, what: str, fn: Callable[[], Any], buffers: tuple[Any, ...],
               async_op: bool = True) -> list[PendingCollective]:
        """Queue ``fn`` on the group's worker, behind the calls issued before it; or run it now, in call order."""
        if async_op:
            return [worker_of(self._ferro).submit(fn, f"{what} on rank {self._ferro.rank}", buffers)]
        worker_of(self._ferro).run(fn, f"{what} on rank {self._ferro.rank}", buffers)
        return []

    # --- reductions -------------------------------------------------------------------

    def allreduce(self, tensors: Any, opts: Any = None) -> FerroWork | None:
        """Reduce each tensor across ranks, in place (torch's ``all_reduce``)."""
        # The fast path of torch's blocking all_reduce of one tensor: ferro's compiled direct call, and no
        # work at all (torch takes None as "done" from a blocking call).
        # ferro.allreduce takes a plain CPU tensor through its NumPy view, and refuses what it cannot take.
        if (type(opts) is _AllreduceOptions and not opts.asyncOp and len(tensors) == 1 and opts.reduceOp == _SUM
                and not tensors[0].requires_grad and not tensors[0].is_sparse):  # those are detached first
            collective.allreduce(tensors[0], ReduceOp.SUM, group=self._ferro, timeout=timeout_of(opts))
            return None
        if any(getattr(t, "is_sparse", False) for t in as_list(tensors)):
            return self._sparse_allreduce(as_list(tensors), opts)
        return self.allreduce_coalesced(tensors, opts)

    def _sparse_allreduce(self, tensors: list[Any], opts: Any) -> FerroWork:
        """Sum sparse COO tensors across ranks, in place (as gloo: every rank's entries, coalesced).

        Ranks hold different numbers of entries, so each rank's indices and
        values travel whole (an all-gather of objects, between the job's
        authenticated ranks), and every rank adds them up the same way.
        """
        op, factor = torch_reduce_op(getattr(opts, "reduceOp", dist.ReduceOp.SUM), "allreduce")
        if op is not ReduceOp.SUM or factor is not None:
            raise InvalidBufferError(f"rank {self._ferro.rank}: allreduce: sparse tensors reduce with SUM only")
        for tensor in tensors:
            if tensor.layout != torch.sparse_coo or tensor.device.type != "cpu":
                raise InvalidBufferError(f"rank {self._ferro.rank}: allreduce: a sparse tensor must be a CPU "
                                         f"sparse_coo tensor, not {tensor.layout} on {tensor.device}")
        sums: list[Any] = []

        def run() -> None:
            for tensor in tensors:
                local = tensor.detach().coalesce()
                parts = collective.all_gather_object((local.indices(), local.values()), group=self._ferro,
                                                     timeout=timeout_of(opts))
                sums.append(torch.sparse_coo_tensor(torch.cat([i for i, _ in parts], dim=1),
                                                    torch.cat([v for _, v in parts]), tensor.shape).coalesce())

        def finish() -> None:
            for tensor, total in zip(tensors, sums, strict=True):
                tensor.copy_(total)

        return self._work("allreduce", self._queue("allreduce", run, (), is_async(opts)), tensors, finish)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> FerroWork:
        """Reduce every tensor of the list across ranks, in place (a call per tensor, in list order)."""
        tensors = as_list(tensors)
        op, factor = torch_reduce_op(opts if isinstance(opts, (dist.ReduceOp, _RedOpType)) else
                                getattr(opts, "reduceOp", dist.ReduceOp.SUM), "allreduce")
        flats = [flat_view(t, "allreduce") for t in tensors]
        if factor is not None:  # PREMUL_SUM: the inputs are the outputs, so they are scaled where they are
            for flat in flats:
                flat.mul_(factor_value(factor))
        timeout, async_op = timeout_of(opts), is_async(opts)
        issued = [collective.allreduce(flat, op, group=self._ferro, timeout=timeout, async_op=async_op)
                  for flat in flats]
        return self._work("allreduce", issued, tensors)

    def reduce(self, tensors: Any, opts: Any = None) -> FerroWork:
        """Reduce each tensor into the copy on ``opts.rootRank``; the others' are left as they were."""
        tensors = as_list(tensors)
        op, factor = torch_reduce_op(getattr(opts, "reduceOp", dist.ReduceOp.SUM), "reduce")
        root = int(getattr(opts, "rootRank", 0))
        flats = [flat_view(t, "reduce") for t in tensors]
        sources = [flat if factor is None else scaled(flat, factor) for flat in flats]
        async_op = is_async(opts)
        issued = [collective.reduce(src, root, op, group=self._ferro, timeout=timeout_of(opts), async_op=async_op)
                  for src in sources]

        def finish() -> None:
            if factor is not None and self._ferro.rank == root:
                for flat, src in zip(flats, sources, strict=True):
                    flat.copy_(src)

        return self._work("reduce", issued, tensors, finish)

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None) -> FerroWork:  # noqa: A002
        """Reduce ``input`` across ranks; this rank's equal part lands in ``output``."""
        op, factor = torch_reduce_op(getattr(opts, "reduceOp", dist.ReduceOp.SUM), "reduce_scatter")
        out, source = flat_view(output, "reduce_scatter"), flat_view(input, "reduce_scatter")
        self._check_world_times(source, "input", out, "output", "reduce_scatter")
        if factor is not None:
            source = scaled(source, factor)
        async_op = is_async(opts)
        issued = collective.reduce_scatter(source, op, group=self._ferro, timeout=timeout_of(opts), async_op=async_op,
                                           out=out)
        return self._work("reduce_scatter", [issued], [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> FerroWork:
        """:meth:`reduce_scatter_single` of each ``(output, input)`` pair, as one call."""
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._join("reduce_scatter", works, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> FerroWork:
        """Reduce list ``inputs[i]`` across ranks; element ``rank`` of the result lands in ``outputs[i]``."""
        outputs = as_list(outputs)
        works = [self.reduce_scatter_single(out, torch.cat([flat_view(t, "reduce_scatter") for t in parts]), opts)
                 for out, parts in zip(outputs, inputs, strict=True)]
        return self._join("reduce_scatter", works, outputs)

    # --- data movement ------------------------------------------------------------------

    def broadcast(self, tensors: Any, opts: Any = None) -> FerroWork:
        """Copy each tensor from ``opts.rootRank`` into the others' tensors, in place."""
        tensors = as_list(tensors)
        root = int(getattr(opts, "rootRank", 0) if not isinstance(opts, int) else opts)
        async_op = is_async(opts)
        issued = [collective.broadcast(flat_view(t, "broadcast"), root, group=self._ferro, timeout=timeout_of(opts),
                                       async_op=async_op) for t in tensors]
        return self._work("broadcast", issued, tensors)

    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> FerroWork:  # noqa: A002
        """Concatenate every rank's ``input`` into ``output``, in rank order (torch's ``all_gather_into_tensor``)."""
        out, source = flat_view(output, "all_gather"), flat_view(input, "all_gather")
        self._check_world_times(out, "output", source, "input", "all_gather")
        async_op = is_async(opts)
        issued = collective.all_gather(source, out=out, group=self._ferro, timeout=timeout_of(opts), async_op=async_op)
        return self._work("all_gather", [issued], [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> FerroWork:
        """:meth:`all_gather_single` of each ``(output, input)`` pair, as one call."""
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._join("all_gather", works, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> FerroWork:
        """Gather each ``inputs[i]`` from every rank into the list ``outputs[i]`` (torch's ``all_gather``)."""
        inputs = as_list(inputs)
        works = []
        for parts, tensor in zip(outputs, inputs, strict=True):
            source = flat_view(tensor, "all_gather")
            for part in parts:
                if flat_view(part, "all_gather").numel() != source.numel() or part.dtype != tensor.dtype:
                    raise InvalidBufferError(f"rank {self._ferro.rank}: all_gather: every output tensor needs the "
                                             f"input's {source.numel()} elements of {tensor.dtype}")
            gathered = torch.empty(source.numel() * self._ferro.world_size, dtype=source.dtype)
            work = self.all_gather_single(gathered, source, opts)
            works.append(self._copying(work, gathered, parts, is_async(opts)))
        return self._join("all_gather", works, list(outputs))

    def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> FerroWork:
        """Gather every tensor of ``inputs`` from every rank (``outputs[r][i]`` is rank ``r``'s ``inputs[i]``)."""
        per_input = [[outputs[r][i] for r in range(self._ferro.world_size)] for i in range(len(inputs))]
        work = self.allgather(per_input, inputs, opts)
        return self._join("all_gather", [work], list(outputs))

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> FerroWork:
        """Gather every rank's ``inputs[0]`` into the list ``outputs[0]`` on ``opts.rootRank``."""
        root = int(getattr(opts, "rootRank", 0))
        inputs = as_list(inputs)
        source = flat_view(inputs[0], "gather")
        parts = list(outputs[0]) if self._ferro.rank == root and len(outputs) else []
        if self._ferro.rank == root and len(parts) != self._ferro.world_size:
            raise ValueError(f"rank {root}: gather: the root needs {self._ferro.world_size} output tensors, got "
                             f"{len(parts)}")
        result: dict[str, Any] = {}

        def run() -> None:
            result["gathered"] = collective.gather(source, root, group=self._ferro, timeout=timeout_of(opts))

        def finish() -> None:
            if parts:
                copy_parts(result["gathered"], parts)

        return self._work("gather", self._queue("gather", run, (source,), is_async(opts)), list(outputs), finish)

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> FerroWork:
        """Send ``inputs[0][i]`` from ``opts.rootRank`` into ``outputs[0]`` on rank ``i``."""
        root = int(getattr(opts, "rootRank", 0))
        outputs = as_list(outputs)
        out = flat_view(outputs[0], "scatter")
        chunks = [flat_view(t, "scatter") for t in inputs[0]] if self._ferro.rank == root else None
        result: dict[str, Any] = {}

        def run() -> None:
            result["mine"] = collective.scatter(chunks, root, group=self._ferro, timeout=timeout_of(opts))

        def finish() -> None:
            mine = result["mine"]
            if mine.numel() != out.numel() or mine.dtype != out.dtype:
                raise InvalidBufferError(
                    f"rank {self._ferro.rank}: scatter: rank {root} sent {mine.numel()} elements of {mine.dtype}; "
                    f"the output holds {out.numel()} of {out.dtype}")
            out.copy_(mine.view(-1))

        return self._work("scatter", self._queue("scatter", run, (out,), is_async(opts)), outputs, finish)

    def all_to_all_single(self, output: Any, input: Any, output_split_sizes: Sequence[int],  # noqa: A002
                          input_split_sizes: Sequence[int], opts: Any = None) -> FerroWork:
        """Exchange rows of ``input`` (split by ``input_split_sizes``, else evenly) into ``output``."""
        n = self._ferro.world_size
        if input.dim() == 0 or output.dim() == 0:
            raise InvalidBufferError("all_to_all: tensors need at least one dimension to split along")
        rows_in, rows_out = input.shape[0], output.shape[0]
        sends = list(input_split_sizes) or even_splits(rows_in, n, "input")
        recvs = list(output_split_sizes) or even_splits(rows_out, n, "output")
        row_shape = tuple(input.shape[1:])
        source = flat_view(input, "all_to_all").view((rows_in,) + row_shape)
        out = flat_view(output, "all_to_all")
        if out.numel() != sum(recvs) * product(row_shape):
            raise InvalidBufferError(f"rank {self._ferro.rank}: all_to_all: the output has {out.numel()} elements; "
                                     f"the split sizes {recvs} need {sum(recvs)} rows of shape {row_shape}")
        async_op = is_async(opts)
        issued = collective.all_to_all_single_uneven(
            source, sends, recvs, group=self._ferro, timeout=timeout_of(opts), async_op=async_op,
            out=out.view((sum(recvs),) + row_shape))
        return self._work("all_to_all", [issued], [output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> FerroWork:
        """Send ``inputs[j]`` to rank ``j``; ``outputs[i]`` receives rank ``i``'s (sizes may differ)."""
        sources = [flat_view(t, "all_to_all") for t in inputs]
        outs = [flat_view(t, "all_to_all") for t in outputs]
        if len({t.dtype for t in sources + outs}) > 1:
            raise InvalidBufferError("all_to_all: every input and output tensor needs one dtype")
        received = torch.empty(sum(t.numel() for t in outs), dtype=outs[0].dtype)
        work = self.all_to_all_single(received, torch.cat(sources), [t.numel() for t in outs],
                                      [t.numel() for t in sources], opts)
        return self._join("all_to_all", [self._copying(work, received, outs, is_async(opts))], list(outputs))

    def barrier(self, opts: Any = None) -> FerroWork:
        """Complete once every rank has called ``barrier``."""
        async_op = is_async(opts)
        issued = collective.barrier(group=self._ferro, timeout=timeout_of(opts), async_op=async_op)
        return self._work("barrier", [issued], [])

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """Pass a barrier through rank 0 that names the ranks that did not arrive within ``timeout`` (as gloo).

        Every other rank sends rank 0 a token and waits for its answer; rank 0
        waits for every token, then answers. ``torch.distributed.monitored_barrier``
        itself refuses any backend but gloo; call this on the group object.

        Raises:
            RuntimeError: On rank 0, "Rank r failed to pass monitoredBarrier in t ms" (every such rank with
                ``wait_all_ranks``); on the others, that they reached it but rank 0 did not answer.

        """
        seconds = (timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else
                   self._ferro.timeout if timeout is None else float(timeout))
        rank, size, ms = self._ferro.rank, self._ferro.world_size, int(seconds * 1000)
        if size == 1:
            return
        links = self._peer_links("monitored_barrier")
        if rank != 0:
            try:
                links.send_token(0, seconds).result()
                links.recv_token(0, seconds).result()
            except DistributedError as exc:
                raise RuntimeError(f"Rank {rank} successfully reached monitoredBarrier, but received errors while "
                                   f"waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank. "
                                   f"({type(exc).__name__}: {exc})") from exc
            return
        if seconds <= 0:
            raise RuntimeError(f"Rank 0 timed out in monitoredBarrier after {ms} ms.")
        arrivals = {peer: links.recv_token(peer, seconds) for peer in range(1, size)}  # all at once, in parallel
        failed: dict[int, BaseException] = {}
        for peer, arrival in arrivals.items():
            if (error := arrival.exception()) is not None:
                failed[peer] = error
                if not wait_all_ranks:
                    break
        if failed:
            first, why = next(iter(failed.items()))
            ranks = (f"Ranks {', '.join(map(str, failed))}" if wait_all_ranks and len(failed) > 1
                     else f"Rank {first}")
            raise RuntimeError(f"[Rank 0]: {ranks} failed to pass monitoredBarrier in {ms} ms "
                               f"({type(why).__name__}: {why})") from why
        for answer in [links.send_token(peer, seconds) for peer in range(1, size)]:
            answer.result()

    # --- point to point ----------------------------------------------------------------

    def _peer_links(self, name: str) -> PeerLinks:
        if self._links is None:
            if self._ferro.world_size > 1:
                raise ConfigurationError(f"{name}: this group carries collectives only (a ferro.elastic group, "
                                         f"re-formed at every membership change); send point to point on a group "
                                         f"from torch.distributed.new_group(backend='ferro')")
            raise ValueError(f"{name}: a group of one rank has no peer to send to or receive from")
        return self._links

    def send(self, tensors: Any, dst: int, tag: int = 0) -> FerroWork:
        """Send each tensor to group rank ``dst`` with ``tag``; returns once queued (``wait()`` for sent).

        Sends to a peer leave in call order, on a connection of their own: they
        never wait behind this group's collectives or its receives.
        """
        tensors = as_list(tensors)
        links = self._peer_links("send")
        pendings = [links.send(flat_view(t, "send"), dst, tag) for t in tensors]
        return self._work(f"send to rank {dst}", pendings, tensors)

    def recv(self, tensors: Any, src: int, tag: int = 0) -> FerroWork:
        """Receive ``src``'s next messages into the tensors; they must carry ``tag``, dtype and size alike."""
        tensors = as_list(tensors)
        links = self._peer_links("recv")
        pendings = [links.recv(flat_view(t, "recv"), src, tag) for t in tensors]
        return self._work(f"recv from rank {src}", pendings, tensors)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> FerroWork:
        """Receive the next message with ``tag`` from whichever rank sends one; the work's ``_source_rank()`` names it.

        Per sender, messages are received in the order sent; receives already
        posted for a named sender come first.
        """
        tensors = as_list(tensors)
        if len(tensors) != 1:
            raise ValueError(f"rank {self._ferro.rank}: recv from any source takes one tensor, got {len(tensors)}")
        sender = self._peer_links("recv").recv_any(flat_view(tensors[0], "recv"), tag)
        work = self._work("recv from any source", [sender], tensors)
        work.source = sender
        return work

    # --- coalescing and life cycle ------------------------------------------------------------

    def start_coalescing(self, device: Any = None) -> None:
        """Start collecting the calls that :meth:`end_coalescing` returns as one work."""
        self._coalescing = []

    def end_coalescing(self, device: Any = None) -> FerroWork:
        """Return one work for the calls made since :meth:`start_coalescing`."""
        works, self._coalescing = self._coalescing or [], None
        return self._join("coalesced calls", works, [])

    def _join(self, what: str, works: Sequence[FerroWork], value: Any) -> FerroWork:
        """Return one work that completes (with ``value``) when every work of ``works`` has."""
        if self._coalescing is not None:
            for work in works:  # the parts were recorded as they were made; the whole is what counts
                if work in self._coalescing:
                    self._coalescing.remove(work)
        # Queued behind every part (a group completes its calls in order), so the waits return at once.
        def wait_all() -> None:
            for work in works:
                work.wait()

        unfinished = [work for work in works if not work.is_completed()]
        pendings = self._queue(what, wait_all, ()) if unfinished else []
        return self._work(what, pendings, value, None if unfinished else wait_all)

    def _copying(self, work: FerroWork, source: Any, parts: Sequence[Any], async_op: bool) -> FerroWork:
        """Return a work that, once ``work`` completes, copies ``source`` into ``parts`` (in order)."""
        def copy_out() -> None:
            work.wait()
            copy_parts(source, parts)

        return FerroWork(f"{work._what} (copy out)", self._queue("copy out", work.wait, (), async_op), list(parts),
                         copy_out)

    def shutdown(self) -> None:
        """Close the ferro group (``destroy_process_group`` calls this)."""
        if self._links is not None:
            self._links.close()
        self._ferro.close()

    def abort(self) -> None:
        """Close the ferro group at once; calls in flight fail."""
        self.shutdown()

    def __repr__(self) -> str:
        return f"<ProcessGroupFerro {self._torch_name or 'group'} over {self._ferro!r}>"


register()
