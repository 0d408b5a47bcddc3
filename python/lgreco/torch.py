"""lgreco for PyTorch training scripts.

Registration (for the GPU product path, LD_PRELOAD or the net plugin)::

    from lgreco.torch import register_ddp
    ddp = torch.nn.parallel.DistributedDataParallel(model, ...)
    register_ddp(ddp, "model.json")   # rank 0 writes the file once DDP's buckets are final

A DDP comm hook for CPU jobs (gloo), compressing with the same engine and controller::

    from lgreco.torch import CommHookState, comm_hook
    ddp.register_comm_hook(CommHookState(ddp), comm_hook)

register_ddp and the rest of lgreco.register (docs/REGISTER_TOOL.md) import torch only
when called, so importing this module does not need it. The hook's parameters are the
process's LGRECO_* variables (lgreco-run's options), as for the library everywhere.
"""

import concurrent.futures
import json
import os
import socket

from . import LgrecoError
from .register import _FILE_DTYPES  # the registration file's dtype names
from .register import Registration, RegisterError, bucket_layout, register_ddp, registration, write_registration

__all__ = ["register_ddp", "Registration", "RegisterError", "bucket_layout", "registration", "write_registration",
           "CommHookState", "comm_hook"]

# Iterations passed to the process group before the layout is read: DDP rebuilds its
# buckets after the first (torch's own PowerSGD hook likewise starts at iteration 2 or later).
_LAYOUT_ITERATION = 1
_DTYPE_CODES = {"torch.float32": 0, "torch.float16": 1, "torch.bfloat16": 2}


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _global_rank(dist, group, rank):
    if group is None or group is dist.group.WORLD:
        return rank
    if hasattr(dist, "get_global_rank"):  # torch 2.x
        return dist.get_global_rank(group, rank)
    return dist.distributed_c10d._get_global_rank(group, rank)  # noqa: SLF001 (torch 1.13)


class CommHookState:
    """The state of lgreco's DDP comm hook for one DDP model and process group.

    Create it on every rank, after init_process_group and DDP, before training (it agrees
    on the rendezvous address with a broadcast over the process group):
    ``ddp.register_comm_hook(CommHookState(ddp), comm_hook)``.

    Iterations 0 and 1 go to the process group's allreduce (DDP rebuilds its buckets
    after the first); the layout comes from iteration 1's buckets, and from iteration 2
    on every bucket goes through lgreco's engine on a worker thread, over lgreco's own
    sockets (rank 0 listens on MASTER_ADDR at LGRECO_RENDEZVOUS_PORT, or a free port it
    tells the others). A later change of the layout passes that iteration through and
    starts a new engine (its residuals and statistics start afresh) at the next.
    """

    def __init__(self, ddp, process_group=None):
        import torch.distributed as dist  # noqa: PLC0415
        self._dist = dist
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._names = {id(p): name for name, p in ddp.module.named_parameters()}
        port = int(os.environ.get("LGRECO_RENDEZVOUS_PORT") or 0) or (_free_port() if self.rank == 0 else 0)
        address = [os.environ.get("MASTER_ADDR", "127.0.0.1"), port]
        dist.broadcast_object_list(address, src=_global_rank(dist, self.group, 0), group=self.group)
        self.master_host, self.master_port = address[0], int(address[1])
        self.iteration = -1          # DDP's iteration, counted at each bucket 0
        # The autograd thread's: the layout being recorded (an iteration passed through),
        # the layout the engine runs with, the iteration that is the engine's step 0, and
        # whether this iteration's buckets differ from it.
        self._recording = None
        self._engine_layout = None
        self._first_step = 0
        self._layout_changed = False
        self._entries = {}           # per bucket index: (what identifies it, its layout entry)
        # The worker thread's: the engine, opened at its first call.
        self._session = None
        self._error = None
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lgreco-hook")
        self.compressed_calls = 0
        self.passed_through_calls = 0

    # -- the worker thread ---------------------------------------------------------------
    @staticmethod
    def _layout_document(layout):
        buckets = []
        for index in sorted(layout):
            count, dtype, layers = layout[index]
            buckets.append({"count": count, "dtype": _FILE_DTYPES[dtype], "layers": layers})
        return json.dumps({"version": 1, "model": "ddp-comm-hook", "buckets": buckets})

    def _reduce_plain(self, buffer):
        self._dist.all_reduce(buffer, group=self.group)
        buffer.div_(self.world_size)
        self.passed_through_calls += 1

    def _run(self, index, buffer, dtype, layout, step):
        """One bucket: through the engine when `layout` is given, else the process group."""
        from . import _native  # noqa: PLC0415
        if self._error is not None:
            raise LgrecoError("an earlier call failed: %s" % self._error)
        try:
            if layout is None:
                self._reduce_plain(buffer)
                return buffer
            if self._session is None:
                self._session = _native.Session(self.rank, self.world_size, self.master_host, self.master_port,
                                                self._layout_document(layout))
            rc = self._session.allreduce_mean(index, step, buffer.data_ptr(), buffer.numel(), _DTYPE_CODES[dtype])
            if rc == _native.PASS_THROUGH:
                self._reduce_plain(buffer)
            else:
                self.compressed_calls += 1
            return buffer
        except Exception as e:
            self._error = str(e)
            raise

    def _close_in_worker(self):
        if self._session is not None:
            self._session.close()
            self._session = None

    # -- DDP's autograd thread -------------------------------------------------------------
    def _start_iteration(self):
        self.iteration += 1
        if self._engine_layout is not None and self._layout_changed:
            # DDP's buckets changed: a new engine after one iteration that records them.
            self._worker.submit(self._close_in_worker)
            self._engine_layout = None
        elif self._engine_layout is None and self._recording and self.iteration - 1 >= _LAYOUT_ITERATION:
            self._engine_layout = self._recording
            self._first_step = self.iteration
        self._layout_changed = False
        self._recording = {} if self._engine_layout is None else None

    def _bucket_entry(self, index, buffer, dtype, params):
        """(count, dtype, layers) of a bucket as the layout document holds it. The layer
        list is built again only when the bucket's parameters (the same tensors, the same
        sizes) or its buffer changed, not at every call."""
        key = (buffer.numel(), dtype, tuple((id(p), p.shape) for p in params))
        cached = self._entries.get(index)
        if cached is not None and cached[0] == key:
            return cached[1]
        layers = []
        offset = 0
        for p in params:
            n = p.numel()
            if n:
                layers.append({"name": self._names.get(id(p), "bucket%d.param%d" % (index, len(layers))),
                               "offset": offset, "numel": n, "shape": [int(d) for d in p.shape]})
            offset += n
        entry = (buffer.numel(), dtype, layers)
        self._entries[index] = (key, entry)
        return entry

    def _submit(self, bucket):
        import torch  # noqa: PLC0415
        index = bucket.index()
        buffer = bucket.buffer()
        if buffer.is_cuda:
            raise LgrecoError("lgreco's comm hook compresses CPU buckets (gloo) only; on GPUs lgreco works inside "
                              "NCCL: start the job with lgreco-run (LD_PRELOAD) and register no hook")
        if index == 0:
            self._start_iteration()
        dtype = str(buffer.dtype)
        entry = self._bucket_entry(index, buffer, dtype, bucket.parameters())
        layout = None
        if self._engine_layout is None:
            if dtype in _DTYPE_CODES:
                self._recording[index] = entry
        elif self._engine_layout.get(index) != entry:
            self._layout_changed = True
        elif not self._layout_changed:
            layout = self._engine_layout
        future = torch.futures.Future()

        def done(job):
            try:
                future.set_result(job.result())
            except Exception as e:  # noqa: BLE001 (every error reaches DDP with its message)
                future.set_exception(RuntimeError("lgreco comm hook, rank %d, bucket %d: %s" % (self.rank, index, e)))

        self._worker.submit(self._run, index, buffer, dtype, layout,
                            self.iteration - self._first_step).add_done_callback(done)
        return future

    def summary(self):
        """One line: the engine's counters, or that it has not started."""
        def text():
            if self._session is None:
                return "no engine (%d calls through the process group)" % self.passed_through_calls
            return self._session.summary()
        return "lgreco comm hook: rank %d/%d: %s" % (self.rank, self.world_size, self._worker.submit(text).result())

    def counters(self):
        """The engine's counters (plugin/hook/lgreco_hook.h), or None before it started."""
        return self._worker.submit(lambda: self._session.counters() if self._session else None).result()

    def close(self):
        """Waits for the worker and closes the engine. Call it on every rank."""
        self._worker.submit(self._close_in_worker).result()
        self._worker.shutdown(wait=True)


def comm_hook(state, bucket):
    """DDP comm hook: the mean of the bucket over the ranks, through lgreco's engine."""
    return state._submit(bucket)  # noqa: SLF001 (the state's own protocol)
