"""The FSDP step as a state machine: the hooks that gather a unit before it computes and free it after.

Forward gathers each unit just before it runs (and, with prefetch, issues the
next one's gather); backward gathers it again, then reduce-scatters its
gradients and frees it; the end of backward waits for the reductions and puts
every unit back to its shards. :class:`StepHooks` holds this per-step state; the
:class:`~ferro.parallel.fsdp.FSDP` wrapper owns the units and the options.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ferro.collective import ReduceOp, all_gather, allreduce, reduce_scatter
from ferro.collective.work import worker_of
from ferro.errors import CollectiveMismatchError, DistributedError
from ferro.parallel.fsdp.flat import FlatGroup
from ferro.parallel.fsdp.unit import BACKWARD, FORWARD, PHASE_NAMES, Unit, UnitState, unit_tag

if TYPE_CHECKING:
    from ferro.parallel.fsdp.api import FSDP

__all__ = ["StepHooks", "tensors_in"]


class StepHooks:
    """The per-step state of one :class:`~ferro.parallel.fsdp.FSDP` and the hooks that drive it."""

    def __init__(self, fsdp: FSDP) -> None:
        self.fsdp = fsdp
        self._forward_order: list[Unit] = []
        self._last_order: list[Unit] = []
        self._position = 0
        self._backward_position = 0
        self.in_step = False
        self._finish_queued = False
        self.reduces: list[tuple[Unit, Callable[[], list[Any]]]] = []  # each unit's wait for its reduced grads
        self.stats = {"all_gather_seconds": 0.0, "all_gather_wait_seconds": 0.0, "all_gathers": 0,
                      "peak_unsharded_units": 0}

    def install(self) -> None:
        """Install the hooks on every unit: torch forward hooks, or a wrapped forward and backward for ferro.nn."""
        for unit in self.fsdp.units:
            if self.fsdp._torch:
                unit.module.register_forward_pre_hook(self._torch_pre_forward(unit))
                unit.module.register_forward_hook(self._torch_post_forward(unit))
            else:
                self._wrap_numpy_unit(unit)

    def _wrap_numpy_unit(self, unit: Unit) -> None:
        module = unit.module
        forward, backward = module.forward, module.backward

        def wrapped_forward(*inputs: Any) -> Any:
            inputs = self._pre_forward(unit, inputs)
            output = forward(*inputs)
            self._post_forward(unit, bool(module.training))
            return output

        def wrapped_backward(grad_output: Any) -> Any:
            self._pre_backward(unit)
            grad_input = backward(grad_output)
            self._post_backward(unit)
            return grad_input

        object.__setattr__(module, "forward", wrapped_forward)
        object.__setattr__(module, "backward", wrapped_backward)

    def _torch_pre_forward(self, unit: Unit) -> Callable[..., Any]:
        def hook(_module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return self._pre_forward(unit, args)
        return hook

    def _torch_post_forward(self, unit: Unit) -> Callable[..., Any]:
        torch = self.fsdp._torch

        def hook(_module: Any, _args: Any, output: Any) -> None:
            grad = torch.is_grad_enabled()
            hooked = grad and self.hook_outputs(output, lambda: self._pre_backward(unit))
            if grad and not hooked and any(group.requires_grad for group in unit.groups):
                # No output we can hook (a custom container?): nothing would re-gather the unit before its
                # backward reads the saved views, so it stays gathered until its gradients are reduced.
                return
            self._post_forward(unit, grad)
        return hook

    def hook_outputs(self, output: Any, fn: Callable[[], None]) -> bool:
        """Call ``fn`` when the gradient of any tensor in ``output`` is ready; return whether any was hooked."""
        torch = self.fsdp._torch

        def on_grad(_grad: Any) -> None:
            fn()

        hooked = False
        for tensor in tensors_in(output, torch.Tensor):
            if tensor.requires_grad:
                tensor.register_hook(on_grad)
                hooked = True
        return hooked

    # --- the step -----------------------------------------------------------------------

    def begin(self) -> None:
        """Start a step (settling the last one first if it had no backward)."""
        if self.in_step:
            self.settle()  # the last forward had no backward (evaluation): put everything back first
        self.in_step = True
        self._position = self._backward_position = 0
        self._forward_order = []

    def _pre_forward(self, unit: Unit, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        if not self.in_step:
            self.begin()
        position = self._position
        self._position += 1
        self._forward_order.append(unit)
        if unit.state is UnitState.SHARDED and unit.pending is None:
            self._issue_gather(unit, unit_tag(unit, position, FORWARD))
        if self.fsdp.forward_prefetch:
            upcoming = self._predict(position + 1)
            if upcoming is not None and upcoming is not unit:
                self._prefetch(upcoming, unit_tag(upcoming, position + 1, FORWARD))
        self._wait_gather(unit, "forward")
        for group in unit.groups:
            self.fsdp._tensors.install(group)
        if self.fsdp.mixed_precision.param_dtype is not None:
            inputs = self.fsdp._tensors.cast_inputs(inputs, unit.groups[0].compute_dtype)
        return inputs

    def _predict(self, position: int) -> Unit | None:
        order = self._last_order
        return order[position] if position < len(order) else None

    def _post_forward(self, unit: Unit, backward_follows: bool) -> None:
        if self.fsdp._reshard_after_forward or not backward_follows:
            self._reshard(unit)

    def _pre_backward(self, unit: Unit) -> None:
        if unit.backward_started:
            return
        unit.backward_started = True
        if self.fsdp._torch and not self._finish_queued:
            self._finish_queued = True
            self.fsdp._torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
        position = self._backward_position
        self._backward_position += 1
        unit.backward_tag = unit_tag(unit, position, BACKWARD)
        if unit.state is UnitState.SHARDED and unit.pending is None:
            self._issue_gather(unit, unit.backward_tag)
        if self.fsdp.forward_prefetch:
            earlier = self._earlier_in_forward(unit)
            if earlier is not None:
                self._prefetch(earlier, unit_tag(earlier, position + 1, BACKWARD))
        self._wait_gather(unit, "backward")
        if not self.fsdp._torch:
            for group in unit.groups:
                self.fsdp._tensors.install(group)
        unit.grads_waiting = 0
        for group in unit.groups:
            self.fsdp._tensors.begin_backward(group)
            unit.grads_waiting += group.requires_grad

    def _earlier_in_forward(self, unit: Unit) -> Unit | None:
        order = self._forward_order
        if unit not in order:
            return None
        index = order.index(unit)
        for candidate in reversed(order[:index]):
            if not candidate.backward_started:
                return candidate
        return None

    def on_grad(self, group: FlatGroup) -> None:
        """torch: one group's gathered gradient is complete (its leaf's post-accumulate hook)."""
        unit = self.fsdp._unit_of[id(group)]
        if not unit.backward_started:  # its outputs could not be hooked: it stayed gathered (see post-forward)
            self._pre_backward(unit)
        unit.grads_waiting -= 1
        if unit.grads_waiting <= 0:
            self._post_backward(unit)

    def _post_backward(self, unit: Unit) -> None:
        if unit.reduced:
            return
        unit.reduced = True
        grads = [self.fsdp._tensors.take_grad(group) for group in unit.groups]
        if any(grad is not None for grad in grads) and self.fsdp._comm is not None:
            shard_group, replicate_group, tag = self.fsdp.shard_group, self.fsdp.replicate_group, unit.backward_tag
            shards = self.fsdp._shard_size

            def reduce() -> list[Any]:
                results = []
                for grad in grads:
                    if grad is not None:
                        if shards > 1:
                            grad = reduce_scatter(grad, ReduceOp.MEAN, group=shard_group, tag=tag)
                        if replicate_group is not None and replicate_group.world_size > 1:
                            allreduce(grad, ReduceOp.MEAN, group=replicate_group)
                    results.append(grad)
                return results

            pending = worker_of(self.fsdp._comm).submit(reduce, f"FSDP reduce of unit {unit.label}", tuple(grads))
            self.reduces.append((unit, pending.wait))
        elif any(grad is not None for grad in grads):  # one rank, nothing to average
            self.reduces.append((unit, lambda: grads))
        self._reshard(unit)

    def finish_backward(self) -> None:
        """End backward: reduce what is left, wait for every reduction, add it to the shards' gradients."""
        self._finish_queued = False
        try:
            for unit in reversed(self._forward_order):
                if unit.backward_started and not unit.reduced:
                    self._post_backward(unit)  # some of its parameters got no gradient this step
            for unit, wait in self.reduces:
                with self.naming(unit, "reduce_scatter"):
                    results = wait()
                for group, reduced in zip(unit.groups, results, strict=True):
                    if reduced is not None:
                        self.fsdp._tensors.add_grad(group.shard, reduced)
        finally:
            self.reduces = []
            self.settle()

    def settle(self) -> None:
        """End a step: wait for stray prefetches and reshard every unit (keeping those that alias their shards)."""
        try:
            for unit in self.fsdp.units:
                if unit.pending is not None:
                    self._wait_gather(unit, "a prefetch nobody used")
                self._reshard(unit)
        finally:
            for unit in self.fsdp.units:
                unit.backward_started = unit.reduced = False
            if self._forward_order:
                self._last_order = self._forward_order
            self.in_step = False

    def reset(self) -> None:
        """Forget a step that failed part-way (a lost rank): every unit back to its shard, no gradient kept.

        A gather or reduction still queued on the old group is waited for (its
        group is closed, so it fails at once) before its buffers are freed: a
        torch buffer is released in place, under a collective that might still
        write into it. Partial gradients are dropped, so the step can be redone.
        """
        for unit in self.fsdp.units:
            if unit.pending is not None:
                with contextlib.suppress(BaseException):  # the step's failure was already reported
                    unit.pending.wait()
                unit.pending = None
            for group in unit.groups:
                self.fsdp._tensors.take_grad(group)
            if unit.state is not UnitState.SHARDED:
                for group in unit.groups:
                    self.fsdp._tensors.uninstall(group)
                    self.fsdp._tensors.free(group)
                unit.state = UnitState.SHARDED
            unit.backward_started = unit.reduced = False
            unit.grads_waiting = 0
        for _unit, wait in self.reduces:
            with contextlib.suppress(BaseException):
                wait()
        self.reduces = []
        self.in_step = self._finish_queued = False
        self._position = self._backward_position = 0
        self._forward_order = []

    # --- gathering and freeing ---------------------------------------------------------

    def _prefetch(self, unit: Unit, tag: int) -> None:
        if unit.state is UnitState.SHARDED and unit.pending is None:
            self._issue_gather(unit, tag)

    def _issue_gather(self, unit: Unit, tag: int) -> None:
        transfers = []
        for group in unit.groups:
            if group.shard_size == 1:
                self.fsdp._tensors.alias(group)
            else:
                transfers.append(self.fsdp._tensors.gather_buffers(group))
        unit.state = UnitState.GATHERING
        self._count_unsharded()
        if not transfers:
            unit.state = UnitState.UNSHARDED
            return
        shard_group, stats = self.fsdp.shard_group, self.stats

        def gather_all() -> None:
            began = time.perf_counter()
            for source, out in transfers:
                all_gather(source, out=out, group=shard_group, tag=tag)
            stats["all_gather_seconds"] += time.perf_counter() - began

        stats["all_gathers"] += 1
        assert shard_group is not None
        unit.pending = worker_of(shard_group).submit(gather_all, f"FSDP all_gather of unit {unit.label}",
                                                     tuple(b for pair in transfers for b in pair))

    def _wait_gather(self, unit: Unit, phase: str) -> None:
        pending = unit.pending
        if pending is not None:
            began = time.perf_counter()
            try:
                with self.naming(unit, f"{phase} all_gather"):
                    pending.wait()
            finally:
                self.stats["all_gather_wait_seconds"] += time.perf_counter() - began
                unit.pending = None
        unit.state = UnitState.UNSHARDED

    def _reshard(self, unit: Unit) -> None:
        if unit.state is UnitState.SHARDED:
            return
        if unit.pending is not None:
            self._wait_gather(unit, "reshard")  # never free memory a collective is still writing
        if unit.keeps_gathered:
            return
        for group in unit.groups:
            self.fsdp._tensors.uninstall(group)
            self.fsdp._tensors.free(group)
        unit.state = UnitState.SHARDED

    def _count_unsharded(self) -> None:
        gathered = sum(unit.state is not UnitState.SHARDED for unit in self.fsdp.units)
        self.stats["peak_unsharded_units"] = max(self.stats["peak_unsharded_units"], gathered)

    # --- errors -------------------------------------------------------------------------

    @contextlib.contextmanager
    def naming(self, unit: Unit, what: str) -> Iterator[None]:
        """Re-raise a collective mismatch with the FSDP units its tags stand for."""
        try:
            yield
        except CollectiveMismatchError as exc:
            raise CollectiveMismatchError(
                f"FSDP: rank {self.fsdp.group.rank} was at unit {unit.label} ({what}) when the ranks' calls differed "
                f"-- {exc}{self._legend(str(exc))}", exc.peer, exc.expected, exc.actual) from exc
        except DistributedError as exc:
            if exc.args and isinstance(exc.args[0], str):  # keep the type (and its fields), say where FSDP was
                exc.args = (f"{exc.args[0]} [FSDP: rank {self.fsdp.group.rank} was at unit {unit.label} ({what})]",
                            *exc.args[1:])
            raise

    def _legend(self, message: str) -> str:
        tags = sorted({int(t) for t in re.findall(r"(?<!thread )\btag (\d+)", message)})
        if not tags:
            return ""
        limit = 2 * len(self.fsdp.units) + 2
        names = []
        for tag in tags:
            hits = [f"{unit.label} as {PHASE_NAMES[phase]} #{position + 1} of the step"
                    for unit in self.fsdp.units for position in range(limit) for phase in (FORWARD, BACKWARD)
                    if unit_tag(unit, position, phase) == tag]
            names.append(f"tag {tag} = {' or '.join(hits) if hits else 'no FSDP unit of this model'}")
        return ". FSDP tags: " + "; ".join(names) + (
            ". The ranks ran different units, or the same units in a different order: every rank must run "
            "the same forward")

    def queue_finish(self) -> None:
        """torch: run :meth:`finish_backward` once autograd has finished this backward."""
        if not self._finish_queued:
            self._finish_queued = True
            self.fsdp._torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def require_idle(self, what: str) -> None:
        """Settle a step left without backward; refuse ``what`` while a backward is under way."""
        if self.in_step:
            self.settle()  # a forward without backward: nothing of the step is left to use
        if self.reduces:
            raise RuntimeError(f"FSDP.{what}: called during backward")


def tensors_in(value: Any, tensor_type: type) -> Iterator[Any]:
    """Yield every ``tensor_type`` in ``value``, looking into lists, tuples and dicts."""
    if isinstance(value, tensor_type):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item, tensor_type)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item, tensor_type)
