"""One pipeline step over microbatches, for a partitioned model with pp > 1.

pp_rank 0 drives: it runs the step body once per microbatch, each in a worker thread,
admitting microbatches by the schedule's limit for rank 0 and asking it when a finished forward
may run its backward. The body's calls into other ranks' modules are sent without waiting
(server.py), so a worker runs its microbatch's forward code ahead of the stages that compute it.
When a microbatch's forward code is over, pp_rank 0 tells every rank (FWD_DONE: they admit new
microbatches by it), and when its body has returned, that the microbatch is finished (MB_DONE:
they drop the values they kept for it). The other ranks serve requests until pp_rank 0 sends
STEP_END with the step's outputs, in one frame with its CLOSE; every rank then closes the step
with its peers and leaves it without waiting for theirs (transport.py). (A rank whose modules a
peer called from inside its own first waits for that peer to be done: server.finish_nested.)

Thread roles on pp_rank 0: the caller's thread starts the first microbatches and waits for the
step's end (a body whose backward makes room for another microbatch starts it); one worker per
microbatch in flight runs the body: the root module's forward, with pp_rank 0's own modules
called where the code calls them, in the body's own autograd graph, and its backward. A body
holds the compute lock while it runs (pp_rank 0 computes one thing at a time, by the schedule's
priority, as every rank does), taking it in microbatch order (turns.py) and giving it up whenever
it waits: for a value from a peer, or for the schedule's permission to start its backward. So a
body's calls to the later stages leave before another microbatch computes here, and rank 0's
modules cost what they cost in one process, not a request each. A body whose forward waited for
a later stage (a loss computed from the last stage's output) runs the rest of it, and issues its
backward's requests, without the lock, and takes it again when its backward reads a gradient to
compute with: another microbatch may hold the lock for long meanwhile (a device's compute).
Transport threads move messages; server threads answer peers' calls into rank 0's modules.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, ContextManager, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from smshim.modelparallel.torch.precision import autocast_state
from smshim.modelparallel.torch.pipeline.scheduler import BACKWARD, FORWARD, ComputeLock, Schedule, make_schedule
from smshim.modelparallel.torch.pipeline.context import ctx
from smshim.modelparallel.torch.pipeline.server import ModuleServer
from smshim.modelparallel.torch.state import state
from smshim.modelparallel.torch.pipeline.packing import pack, unpack
from smshim.modelparallel.torch.pipeline.structure import fill, flatten
from smshim.timeline.recorder import Timeline
from smshim.modelparallel.torch.pipeline.messages import (STEP_END, Message, PipelineError)
from smshim.modelparallel.torch.pipeline.channels import DeviceChannel
from smshim.modelparallel.torch.pipeline.transport import Transport
from smshim.modelparallel.torch.pipeline.wakeup import Wakeup
from smshim.modelparallel.torch.pipeline.workers import Workers, adopt_intra_op_threads
from smshim.runtime import scheduling

logger = logging.getLogger(__name__)


class Pipeline:
    def __init__(self, root: nn.Module, assignment: dict, ranks: List[int], pp_rank: int,
                 groups: Tuple[dist.ProcessGroup, dist.ProcessGroup], pipeline: str,
                 active_microbatches: int, timeline: Timeline, timeout_s: float,
                 device: torch.device, deterministic: bool = False,
                 device_channel: Optional[DeviceChannel] = None) -> None:
        self.pp_rank = pp_rank
        self.pipeline = pipeline
        self.active_microbatches = active_microbatches
        # deterministic_server: microbatch i's backward starts only after every earlier
        # microbatch's backward has finished, so gradients accumulate in the same order on every
        # run (bit-identical results) at the cost of overlapping backwards across microbatches.
        self.deterministic = deterministic
        self._backward_finished: set = set()
        self._live: set = set()  # microbatches whose activations rank 0 holds
        self.timeline = timeline
        self.timeout_s = timeout_s
        self.lock = ComputeLock()
        self.stages = len(ranks)
        # The stage's threads hand work to each other all the time: none preempts the one that
        # woke it, and on a CPU-only host they keep to their rank's cores (runtime/scheduling.py;
        # before the server and transport start theirs, which inherit both and adopt the
        # intra-op thread count).
        scheduling.use_batch_scheduling()
        # (Only when the launcher said how many ranks share the host: guessed from the world
        # size, another host's ranks would count here, and some of its cores go unused.)
        if state.launch.local_known:
            scheduling.bind_to_own_cores(state.launch.local_rank, state.launch.local_size)
        try:
            self.server = ModuleServer(root, assignment, pp_rank, self.lock, timeline,
                                       timeout_s, device, deterministic)
            self.transport = Transport(ranks, pp_rank, groups, self.server.dispatch, timeout_s,
                                       device, timeline, device_channel=device_channel)
            self.server.transport = self.transport
            self.transport.on_error(self.server.wake_all)
            self.transport.on_error(lambda exc: self._wake())
            self.server.install_proxies()
        except BaseException:
            # (No pipeline: the process's threads get their class and cores back, as `close`
            # would give them.)
            scheduling.restore()
            raise
        self.step = 0
        # Data parallelism (ddp: true): the model sets these to its DP-group gradient reduction.
        # `reduce_early` runs, on ranks other than 0, as soon as the rank's own backward work for
        # the step is done (overlapping the other stages' backward); `reduce_at_end` otherwise.
        self.reduce_early: Optional[Callable[[], None]] = None
        self.reduce_at_end: Optional[Callable[[], None]] = None
        self._reduce_lock = threading.Lock()
        self._reduce_future: Optional[Future] = None
        self.early_reductions = 0  # steps whose reduction overlapped the pipeline's drain
        self._reduce_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smp-reduce",
                                               initializer=adopt_intra_op_threads)
        if pp_rank != 0:
            # (pp_rank 0's backward is its step bodies', which end with the step: it reduces
            # then.)
            self.server.on_local_backward_done = self._on_local_backward_done
        # The caller's thread waits on _cond (for the step's end); bodies wait at the gate for
        # their backward's permission, woken only when it may have come: with every body
        # notified of every change, m bodies waiting cost m thread switches per change.
        # (Their lock is taken as `with self._cond_lock`: Condition's `with` is a Python call.)
        self._cond_lock = threading.Lock()
        self._cond = threading.Condition(self._cond_lock)
        self._backward_gate = threading.Condition(self._cond_lock)
        self._schedule: Optional[Schedule] = None
        self._forwards_done = 0
        # pp_rank 0's step in progress, guarded by _cond: microbatches started and finished
        # (body over), the bodies' errors; see _caller_may_act.
        self._started = self._finished = 0
        self._errors: List[Tuple[int, BaseException]] = []
        # pp_rank 0: the threads that run the step body, one microbatch each at a time.
        self._bodies = Workers(f"smp-body-{pp_rank}")
        self._job: Optional[Callable[[int], None]] = None  # runs one microbatch's body

    def _wake(self) -> None:
        with self._cond_lock:
            self._cond.notify_all()
            self._backward_gate.notify_all()

    def _caller_may_act(self) -> bool:
        """(Under _cond.) Has the caller's thread something to do: the step over, a body
        failed? It is notified only then: under `simple` it waited through 2m notifications for
        the last one."""
        return self._finished >= self._schedule.microbatches or bool(self._errors)

    def _start_admitted_locked(self) -> None:
        """(Under _cond.) Start the body of every microbatch the schedule admits now. The
        thread whose backward made room does it: through the caller's thread, each start
        cost one more thread wake (0.3-2.8 ms on a busy core) between a backward and the next
        forward on rank 0, 1F1B's critical path."""
        while self._job is not None and not self._errors and self._schedule.may_start_forward(
                self._started, len(self._backward_finished)):
            self._bodies.run(self._job, self._started)
            self._started += 1

    def _trace(self, kind: str, mb: int, step: int) -> Optional[Callable[[], ContextManager]]:
        """The timeline span of each stretch a body computes under the compute lock, in
        direction `kind` (None when no timeline is recorded)."""
        if not self.timeline.enabled:
            return None
        return lambda: self.timeline.span(f"step body, microbatch {mb}", kind, microbatch=mb,
                                          step=step)

    def _count_live(self, mb: int) -> None:
        """Microbatch `mb` starts its forward with grad enabled: rank 0 holds its activations
        until its backward is over (for the memory benchmark)."""
        with self._cond_lock:
            self._live.add(mb)
            self.server.peak_live_microbatches = max(self.server.peak_live_microbatches,
                                                     len(self._live))

    def _backward_over_locked(self, mb: int) -> None:
        """(Under _cond.) Microbatch `mb`'s backward here is over (or it will have none): it no
        longer counts against rank 0's limit."""
        self._live.discard(mb)
        self._backward_finished.add(mb)
        self._start_admitted_locked()
        if self._caller_may_act():
            self._cond.notify_all()
        if self.deterministic:
            self._backward_gate.notify_all()

    # ---- pp_rank 0 ----------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], mb_inputs: Sequence[Tuple[tuple, dict]]) -> List[Any]:
        m = len(mb_inputs)
        schedule = make_schedule(self.pipeline, m, min(self.active_microbatches, m), self.stages)
        self._schedule = schedule
        self._forwards_done = 0
        self._backward_finished = set()
        self._live = set()
        self._started = self._finished = 0
        self._errors = errors = []
        self.server.begin_step(m, schedule, self.step)
        self.transport.open_session()
        results: List[Any] = [None] * m
        step = self.step

        # A body runs in a worker thread, with the caller's grad mode (a step called under
        # torch.no_grad() builds no graph, here or on the ranks it calls) and autocast.
        grad_enabled = torch.is_grad_enabled()
        amp = autocast_state.capture()

        def body(mb: int) -> None:
            ctx.step, ctx.microbatch, ctx.in_step, ctx.forward_done = step, mb, True, False
            ctx.driver = True
            state.microbatch = mb
            try:
                args, kwargs = mb_inputs[mb]
                self.server.turns.wait_forward(mb, lambda: f"forward of microbatch {mb}")
                if grad_enabled:
                    self._count_live(mb)
                self.lock.acquire(schedule.priority(FORWARD, mb), (FORWARD, mb),
                                  trace=self._trace(FORWARD, mb, step))
                with torch.set_grad_enabled(grad_enabled), autocast_state.applied(amp):
                    out = fn(*args, **kwargs)
                self._mark_forward_done(mb)
                # (values, everywhere; in the step's drain once every forward is over)
                results[mb] = self.server.finish_microbatch(
                    mb, out, drain=self._forwards_done >= schedule.microbatches)
            except BaseException as e:  # noqa: BLE001
                errors.append((mb, e))
                self.transport.fail(PipelineError(
                    f"pp rank 0: the step body failed on microbatch {mb}: {type(e).__name__}: {e}"))
            finally:
                if self.lock.held():
                    self.lock.release()
                ctx.in_step = ctx.driver = False  # (the thread goes on to other work)
                self.server.turns.backward_begun(mb)  # (if it never called model.backward)
                self.server.turns.forward_over(mb)
                with self._cond_lock:
                    self._finished += 1
                    self._backward_over_locked(mb)

        def job(mb: int) -> None:
            try:
                body(mb)
            finally:
                returned[mb].set()

        returned = [Wakeup() for _ in range(m)]  # (waited for only after a failure)
        with self._cond_lock:
            # A microbatch stops counting against rank 0's limit when its backward here is done
            # (its activations are gone), not when its body has fetched its results; the body
            # that made room starts the next one (_backward_over_locked).
            self._job = job
            self._start_admitted_locked()
            while self._finished < m and not errors and self.transport.error is None:
                self._cond.wait(timeout=1.0)
            self._job = None
        started = returned[:self._started]
        if errors or self.transport.error is not None:
            for done in started:
                done.wait(timeout=2.0)
            if errors:
                mb, exc = min(errors, key=lambda e: e[0])
                raise exc
            self.transport.check()
        # (No wait for `returned` otherwise: every body has counted itself finished, the last
        # thing it does with the step's state; waiting would cost the caller one more wake.)
        template, tensors = flatten(results)
        spec, packed = pack(tensors)
        end = Message(STEP_END, step, meta=(template, spec), tensors=packed)
        if self.server.has_nested_callers():
            # Peers that called modules here from inside theirs may still send the backward of
            # those calls: serve it before closing (what it sends must precede the CLOSE).
            for peer in self.transport.peers:
                self.transport.send(peer, end)
            self.server.finish_nested(step)
            self.transport.close_session(step)
        else:
            # Nothing more goes to the peers this step: the results and the CLOSE leave together.
            self.transport.close_session(step, last=end)
        self._finish(step, closed=True)
        return results

    def backward(self, tensors: List[torch.Tensor], grad_tensors: List[Optional[torch.Tensor]]) -> None:
        """model.backward inside a body thread: wait for the schedule's permission, then run the
        backward with backward priority (remote parts run on their owners)."""
        schedule = self._schedule
        mb = ctx.microbatch
        deadline = time.monotonic() + self.timeout_s
        self._mark_forward_done(mb)
        self.server.prefetch(tensors)

        def may_start() -> bool:
            return schedule.may_start_backward(self._forwards_done) and not (
                self.deterministic and not self._backward_finished.issuperset(range(mb)))

        # From here the body's work is its backward: it takes the compute lock back at that
        # priority after a wait (and records no span while it only waits).
        priority, key = schedule.priority(BACKWARD, mb), (BACKWARD, mb)
        self.lock.tag(priority, key)
        with self._cond_lock:
            waits = not may_start()
        if waits or schedule.backwards_begin_in_order:
            # The forward's calls leave before this thread waits. (If it need not wait, they
            # leave with the backward's requests that follow at once: one frame, not two.)
            self.server.send_held()
        if waits:
            with self.lock.released(), self._backward_gate:
                while not may_start():
                    self.transport.check()
                    if time.monotonic() > deadline:
                        raise PipelineError(
                            f"microbatch {mb} waited {self.timeout_s:.0f} s to start its "
                            f"backward: only {self._forwards_done} of {schedule.microbatches} "
                            "forwards finished (does every microbatch call model.backward?)")
                    self._backward_gate.wait(timeout=1.0)
        if schedule.backwards_begin_in_order:
            self.server.turns.wait_backward_begun(mb, (
                f"backward of microbatch {mb} (step {ctx.step}; the {schedule.name} schedule "
                "begins backwards in microbatch order)"), waiting=self.lock.released)
        # A body that holds the compute lock (its forward never waited) keeps it: its requests
        # to the later stages leave before another microbatch computes here, and it gives the
        # lock up once it waits for their gradients. One that does not hold it issues them
        # without it (another microbatch's forward may hold the lock for long: a device's
        # compute); it takes the lock when it reads a gradient to compute with
        # (CallerSide._get_value).
        self.lock.tag(priority, key, self._trace(BACKWARD, mb, ctx.step))
        on_device = any(t.is_cuda for t in tensors)
        if on_device and self.lock.held():
            # The engine runs a CUDA graph's backward in its device threads, not this one: the
            # lock held here would keep rank 0's other work waiting while they compute (their
            # kernels queue on the device's stream, in order) and wait for gradients.
            self.lock.release()
        ctx.in_backward = not on_device
        try:
            torch.autograd.backward(tensors, grad_tensors)
        finally:
            ctx.in_backward = False
            if self.lock.held():
                self.lock.release()
        self.server.turns.backward_begun(mb)  # (if it called no module)
        self.server.send_held()
        with self._cond_lock:
            self._backward_over_locked(mb)

    def _mark_forward_done(self, mb: int) -> None:
        """The microbatch's forward code is over (it called model.backward, or returned)."""
        if ctx.forward_done:
            return
        ctx.forward_done = True
        self.server.turns.forward_over(mb)
        self.server.forward_done(mb)
        # Only the bodies at the gate wait on the count (the caller's thread admits microbatches
        # by backwards finished, not forwards done).
        with self._cond_lock:
            self._forwards_done += 1
            if self._schedule.may_start_backward(self._forwards_done):
                self._backward_gate.notify_all()

    # ---- other pp ranks -----------------------------------------------------------------------
    def serve(self, microbatches: int) -> List[Any]:
        step = self.step
        self.server.begin_step(microbatches, make_schedule(
            self.pipeline, microbatches, min(self.active_microbatches, microbatches), self.stages),
            step)
        self.transport.open_session()
        msg = None
        try:
            msg = self.server.step_end.get(timeout=self.timeout_s)
        except Exception:  # noqa: BLE001  (queue.Empty)
            err = PipelineError(
                f"pp rank {self.pp_rank} waited {self.timeout_s:.0f} s for pp rank 0 (global rank "
                f"{self.transport.ranks[0]}) to finish step {step}: it may have stopped calling "
                "the step function, or died (SMSHIM_TIMEOUT sets this limit)")
            self.transport.fail(err)
            raise err from None
        if msg.kind != STEP_END:
            self.transport.check()
            raise PipelineError(str(msg.meta))
        # pp_rank 0 may end the step while a backward it did not need a result from (a stage
        # whose inputs need no gradient) still runs here: its gradients must be in first.
        self.server.wait_idle(step)
        self.server.finish_nested(step)
        self._finish(step)
        template, spec = msg.meta
        return fill(template, unpack(spec, msg.tensors))

    def _on_local_backward_done(self) -> None:
        with self._reduce_lock:
            if self.reduce_early is not None and self._reduce_future is None:
                self._reduce_future = self._reduce_pool.submit(self.reduce_early)
                self.early_reductions += 1

    def _reduce(self) -> None:
        """The step's gradient reduction must be complete before the step returns."""
        with self._reduce_lock:
            future, self._reduce_future = self._reduce_future, None
        if future is not None:
            future.result(timeout=self.timeout_s)
        elif self.reduce_at_end is not None:
            self.reduce_at_end()

    def _finish(self, step: int, closed: bool = False) -> None:
        self.server.flush_weight_grads()
        self._reduce()
        self.server.end_step()
        if not closed:
            self.transport.close_session(step)
        self.step += 1
        if self.timeline.enabled:
            self.timeline.flush()

    def close(self) -> None:
        self.server.remove_proxies()
        self.transport.shutdown()
        self._bodies.stop()
        self.server.close()
        self._reduce_pool.shutdown(wait=False)
        scheduling.restore()
