"""Distributed data parallel training for ferro.nn and PyTorch modules.

Gradients live in flat *bucket* buffers: each parameter's gradient is a view
into its bucket, so reducing a bucket reduces its gradients with no gather or
scatter copies. Buckets are filled in reverse parameter order, the order
backward produces gradients. During backward, a bucket's allreduce starts as
soon as its last gradient is ready. It runs on the group's worker thread
inside ferro's compiled core, without the GIL, so communication hides behind
the rest of backward; the end of backward waits for every bucket.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from ferro.backend.base import Backend
from ferro.collective import broadcast
from ferro.collective.work import worker_of
from ferro.errors import ConfigurationError
from ferro.parallel._model import Model, TorchModel, model_adapter
from ferro.parallel.comm_hooks import Bucket, CommHook, allreduce_hook, bf16_compress_hook, fp16_compress_hook

__all__ = ["DDP", "Bucket", "CommHook", "allreduce_hook", "bf16_compress_hook", "fp16_compress_hook"]

MB = 1024 * 1024


class DDP:
    """Data-parallel training: every rank runs the same model on its own data; gradients are averaged.

    Wraps a ``ferro.nn`` module or a ``torch.nn.Module`` (CPU). The model's
    parameters are copied from rank 0 when it is wrapped, so every rank starts
    from the same values.

    Args:
        module: The model.
        group: The process group (default: the default group).
        bucket_cap_mb: Bucket size in MiB.
        first_bucket_mb: Size of the first bucket (the last layers' gradients,
            ready first), kept small so communication starts early.
        broadcast_parameters: Copy rank 0's parameters to every rank now.
        comm_hook: How a bucket is reduced (default :func:`allreduce_hook`; compressing hooks are in
            :mod:`ferro.parallel.comm_hooks`).

    Example::

        model = ferro.DDP(nn.Sequential(nn.Linear(64, 10)))
        optimizer = nn.SGD(model.parameters(), lr=0.1)
        loss = criterion(model(x), y)             # x, y: this rank's share of the batch
        optimizer.zero_grad()
        model.backward(criterion.backward())      # ferro.nn; for torch: loss.backward()
        optimizer.step()                          # gradients are averaged over all ranks

    Raises:
        ConfigurationError: No group and no default group, or a module without trainable parameters.

    """

    def __init__(self, module: Any, group: Backend | None = None, bucket_cap_mb: float = 25,
                 first_bucket_mb: float = 1, broadcast_parameters: bool = True,
                 comm_hook: CommHook | None = None) -> None:
        from ferro.collective.resolve import resolve_group

        self.module = module
        self.group = resolve_group(group, "DDP")
        self._model: Model = model_adapter(module)
        self.comm_hook: CommHook = comm_hook or allreduce_hook
        self._syncing = True
        self._finish_queued = False
        self._next_launch = 0  # buckets are reduced strictly in index order, the same order on every rank
        self.buckets = self._build_buckets(bucket_cap_mb, first_bucket_mb)
        self._bucket_of: dict[int, tuple[Bucket, int]] = {}
        for bucket in self.buckets:
            for position, param in enumerate(bucket.parameters):
                self._bucket_of[id(param)] = (bucket, position)
                self._model.hook(param, self._on_grad_ready)
        if broadcast_parameters:
            self.broadcast_parameters(0)

    # --- buckets ------------------------------------------------------------------

    def _build_buckets(self, cap_mb: float, first_mb: float) -> list[Bucket]:
        model = self._model
        params = model.trainable()
        if not params:
            raise ConfigurationError("DDP: the module has no trainable parameters")
        buckets: list[Bucket] = []
        # Reverse definition order is the order backward produces gradients.
        current: dict[str, list[Any]] = {}
        filled: dict[str, int] = {}
        for param in reversed(params):
            key = model.dtype_key(param)
            members = current.setdefault(key, [])
            cap = (first_mb if not any(b.parameters and model.dtype_key(b.parameters[0]) == key for b in buckets)
                   else cap_mb) * MB
            itemsize = self._model.itemsize(param)
            if members and (filled.get(key, 0) + model.size(param)) * itemsize > cap:
                buckets.append(self._make_bucket(len(buckets), members))
                current[key] = members = []
                filled[key] = 0
            members.append(param)
            filled[key] = filled.get(key, 0) + model.size(param)
        for members in current.values():
            if members:
                buckets.append(self._make_bucket(len(buckets), members))
        return buckets

    def _make_bucket(self, index: int, members: list[Any]) -> Bucket:
        offsets, total = [], 0
        for param in members:
            offsets.append(total)
            total += self._model.size(param)
        buffer = self._model.new_buffer(members[0], total)
        for param, offset in zip(members, offsets, strict=True):
            self._model.attach(param, buffer, offset)
        return Bucket(index, buffer, list(members), offsets)

    # --- during backward ----------------------------------------------------------

    def _on_grad_ready(self, param: Any) -> None:
        bucket, position = self._bucket_of[id(param)]
        if isinstance(self._model, TorchModel):
            self._keep_view(param, bucket, position)
            if self._syncing and not self._finish_queued:
                # Wait for every bucket before backward returns, as torch's own DDP does.
                self._model.torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
                self._finish_queued = True
        if not self._syncing:
            return
        if bucket.pending is not None:
            raise RuntimeError(
                f"DDP: a parameter of bucket {bucket.index} received a gradient after the bucket was reduced "
                f"(is it used twice in one forward pass?)")
        bucket.ready.add(position)
        self._launch_in_order()

    def _launch_in_order(self) -> None:
        # A complete bucket waits for the earlier ones: ranks must reduce buckets in one order, and
        # equal-sized buckets carry equal fingerprints, so a different order could pair the wrong data.
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.parameters):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _keep_view(self, param: Any, bucket: Bucket, position: int) -> None:
        """Put the gradient back into the bucket if the optimizer replaced it (zero_grad(set_to_none=True))."""
        offset, size = bucket.offsets[position], param.numel()
        view = bucket.buffer[offset:offset + size].view(param.shape)
        if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            param.grad = view

    def _launch(self, bucket: Bucket) -> None:
        group, hook = self.group, self.comm_hook
        bucket.pending = worker_of(group).submit(lambda: hook(group, bucket), f"DDP bucket {bucket.index}",
                                                 (bucket.buffer,))

    def _finish_backward(self) -> None:
        self._finish_queued = False
        if self._syncing:
            self.sync_gradients()

    # --- public -------------------------------------------------------------------

    def sync_gradients(self) -> None:
        """Average every bucket's gradients over the group and wait until all are done.

        Buckets whose allreduce already started during backward are waited for;
        the others (parameters that got no gradient this step, or gradients set
        by hand) are reduced now.
        """
        group, hook, worker = self.group, self.comm_hook, worker_of(self.group)
        try:
            for bucket in self.buckets:
                if bucket.pending is not None:
                    bucket.pending.wait()
                else:
                    # Not started during backward: reduce it now, in order, on this thread
                    # (run() queues it behind any async work still pending on the group).
                    worker.run(functools.partial(hook, group, bucket), f"DDP bucket {bucket.index}",
                               (bucket.buffer,))
        finally:
            for bucket in self.buckets:
                bucket.pending = None
                bucket.ready.clear()
            self._next_launch = 0

    def backward(self, grad_output: Any) -> Any:
        """Run the ferro.nn module's backward (overlapping communication), then wait for every bucket."""
        if isinstance(self._model, TorchModel):
            raise ConfigurationError("DDP.backward is for ferro.nn modules; with torch, call loss.backward()")
        grad_input = self.module.backward(grad_output)
        if self._syncing:
            self.sync_gradients()
        return grad_input

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block averages the accumulated sum."""
        previous, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = previous

    def broadcast_parameters(self, root: int = 0) -> None:
        """Copy ``root``'s parameters (and torch buffers) into every rank's existing arrays, in place.

        The arrays stay the same objects, so an optimizer created before this
        call keeps working.
        """
        for array in self._model.every_array():
            broadcast(array, root=root, group=self.group)

    def rebind(self, group: Backend) -> None:
        """Reduce over ``group`` from now on, dropping whatever the last backward left in flight.

        The buckets, hooks and parameters stay as they are; only the group
        changes. :class:`ferro.elastic.Manager` calls it when the job's
        membership changes, after the step that failed was abandoned. Every
        parameter must already hold the same values on the new group's ranks.
        """
        self.group = group
        for bucket in self.buckets:
            bucket.pending = None
            bucket.ready.clear()
        self._next_launch = 0
        self._finish_queued = False

    def register_comm_hook(self, hook: CommHook) -> None:
        """Use ``hook(group, bucket)`` to reduce each bucket.

        It runs on the group's worker thread, overlapped with backward, and must
        leave the *average* of the bucket over the group in ``bucket.buffer``
        (see :mod:`ferro.parallel.comm_hooks`: float16, bfloat16, int8 and
        PowerSGD compression).
        """
        self.comm_hook = hook

    # --- the wrapped module's interface -------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module."""
        return self.module(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module."""
        return self.module(*args, **kwargs)

    def parameters(self) -> Any:
        """Return the wrapped module's parameters."""
        return self.module.parameters()

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        """Return the wrapped module's named parameters."""
        return self.module.named_parameters(*args, **kwargs)

    def train(self, mode: bool = True) -> DDP:
        """Set the wrapped module's training mode; return self."""
        self.module.train(mode)
        return self

    def eval(self) -> DDP:
        """Set the wrapped module to evaluation mode; return self."""
        self.module.eval()
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Return the wrapped module's state."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Load state into the wrapped module."""
        return self.module.load_state_dict(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names DDP itself lacks: forward the rest of the module's interface.
        if name == "module":
            raise AttributeError(name)
        return getattr(self.module, name)
