"""Count, on the CPU, the operations of a piece of code that would make the host wait for CUDA.

On CUDA the host queues kernels and runs ahead of the device until it needs a value the device
computes: a scalar read (``.item()``, ``int()``, ``bool()``, ``float()`` of a tensor), a copy to
the host (``.cpu()``, ``.to('cpu')``, ``.tolist()``, ``.numpy()``), an operation whose output
size depends on the data (``nonzero``, ``masked_select``, indexing with a boolean mask, in a read
or a write), or a copy from the host that is not ``non_blocking`` (``.to(device)``,
``torch.tensor(data, device=...)``: torch copies and then waits for the stream). Each such
operation waits for everything queued before it. :class:`SyncCounter` counts them while code
runs on the CPU, where they cost nothing and are invisible:

* a ``TorchDispatchMode`` sees the aten operations (``_local_scalar_dense`` behind every scalar
  read, ``nonzero``, ``masked_select``, ``index.Tensor`` and ``index_put_`` with a boolean index);
* a ``TorchFunctionMode`` sees the copies to the host that on CPU tensors dispatch nothing
  (``tolist``, ``numpy``; ``cpu`` and ``to('cpu')`` return the tensor itself there).

Only operations on tensors that would live on the device count: on CUDA the engine keeps some
state on the host on purpose (lengths, the back-off, lists of rows) and reads it freely. Which
tensors would be on the device is tracked as CUDA would place them: the model's parameters and
buffers and the batch's tensors are, and so is every tensor a torch function computes from one,
every tensor made with an explicit ``device=`` (a ``torch.device`` or a string other than
"cpu") and every tensor moved with ``.to(<torch.device>)``; a tensor made without a device, or
copied to the host, is not. A tensor the code fills outside torch (the fast step's native
kernels write into buffers made without a device) is marked by the caller (:meth:`mark`).

Code that branches on the device type runs its CPU branch here (the fast step and encoder,
numpy shortcuts, the drafters' host bookkeeping): what is counted is what that code would wait
for on CUDA, an upper bound on the CUDA run's count where the CPU branch reads more.
"""

import sys
import weakref
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# aten operations that wait for the device whatever their arguments
_ALWAYS = {
    aten._local_scalar_dense.default: "scalar read",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
}
# aten operations that wait where an index is a boolean mask (its nonzero runs first)
_WITH_BOOL_INDEX = {
    aten.index.Tensor: "boolean index",
    aten.index_put_.default: "boolean index write",
    aten.index_put.default: "boolean index write",
}
# tensor methods that copy to the host without dispatching anything on a CPU tensor
_TO_HOST = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy",
            torch.Tensor.cpu: "cpu"}
# functions making new tensors: on the device only where given one; those copying their data
# from the host do it synchronously (non_blocking=False)
_COPIED_FACTORIES = {torch.tensor, torch.as_tensor}
# functions whose result is on the host whatever their input's device: a shape's sizes
# (fairseq's positional embeddings read them, which on CUDA waits for nothing)
_HOST_RESULTS = {torch._shape_as_tensor}
_FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full, torch.empty,
              torch.arange, torch.rand, torch.randn, torch.randint, torch.eye, torch.linspace}


def _caller() -> str:
    """The nearest frame in the project's package (else the nearest outside torch)."""
    frame, fallback = sys._getframe(2), None
    while frame is not None:
        name = frame.f_code.co_filename
        if "fairseq_pardec" in name:
            return "%s:%d" % (name.split("fairseq_pardec/")[-1], frame.f_lineno)
        if fallback is None and "/torch/" not in name and not name.endswith("sync_counter.py"):
            fallback = "%s:%d" % (name.rsplit("/", 1)[-1], frame.f_lineno)
        frame = frame.f_back
    return fallback or "?"


def _tensors(tree, found=None) -> list:
    """The tensors in ``tree``: nested lists, tuples and dicts (a walk of its own: torch's
    pytree costs more than the operations it would look at)."""
    found = [] if found is None else found
    if isinstance(tree, torch.Tensor):
        found.append(tree)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            _tensors(item, found)
    elif isinstance(tree, dict):
        for item in tree.values():
            _tensors(item, found)
    return found


def _forget(device: dict, key: int, ref) -> None:
    """A marked tensor was freed: forget its id (unless a newer tensor holds it now)."""
    if device.get(key) is ref:
        del device[key]


def _names_the_device(device) -> bool:
    """Whether a ``device=`` argument would place a tensor on CUDA in a CUDA run: a device
    object (the engine passes its batch's), or a string other than "cpu"."""
    if device is None:
        return False
    if isinstance(device, str):
        return device.split(":")[0] != "cpu"
    return isinstance(device, torch.device)


class SyncCounter:
    """``with counter:`` counts the would-be CUDA synchronisations of the code inside, in
    ``counter.total`` and by kind in ``counter.kinds``; ``counter.mark(tensors)`` first for the
    tensors that would live on the device (the model's, the batch's)."""

    def __init__(self):
        # id -> weak reference of each tensor that would live on the device (ids, not the
        # tensors: a set would compare tensors with ``==``, elementwise)
        self._device = {}
        self.kinds = Counter()
        # (kind, "file:line") of the project's frame nearest to each count
        self.places = Counter()
        self.total = 0
        self.paused = 0  # > 0: nothing counts (a part the caller counts as one read)
        self._function_mode = _FunctionMode(self)
        self._dispatch_mode = _DispatchMode(self)

    def mark(self, tree) -> None:
        """Mark the tensors in ``tree`` (any nesting of lists, tuples, dicts) as device tensors."""
        device = self._device
        for t in _tensors(tree):
            key = id(t)
            known = device.get(key)
            if known is None or known() is not t:
                device[key] = weakref.ref(t, lambda ref, key=key: _forget(device, key, ref))

    def mark_module(self, module: torch.nn.Module) -> None:
        self.mark(list(module.parameters()) + list(module.buffers()))

    def on_device(self, t: torch.Tensor) -> bool:
        ref = self._device.get(id(t))
        return ref is not None and ref() is t

    def count(self, kind: str) -> None:
        if self.paused:
            return
        self.kinds[kind] += 1
        self.places[kind, _caller()] += 1
        self.total += 1

    def counted_once(self, function, kind: str = "close-call replay"):
        """``function``, counted as one synchronisation whatever it runs (the close-call
        replay: fairseq's own search, which reads the device at every step)."""

        def once(*args, **kwargs):
            self.count(kind)
            self.paused += 1
            try:
                return function(*args, **kwargs)
            finally:
                self.paused -= 1

        return once

    def __enter__(self):
        self._function_mode.__enter__()
        self._dispatch_mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._dispatch_mode.__exit__(*exc)
        self._function_mode.__exit__(*exc)
        return False


def _non_blocking(args, kwargs) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` copies without waiting (``non_blocking=True``):
    a copy from the host that does not is one synchronisation (torch's memcpy_and_sync)."""
    return bool(kwargs.get("non_blocking")) or any(a is True for a in args[1:])


def _destination(counter: SyncCounter, args, kwargs, from_device: bool) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` would put its tensor on the device."""
    target = kwargs.get("device", kwargs.get("other", args[1] if len(args) > 1 else None))
    if isinstance(target, torch.Tensor):  # .to(other): where other is
        return counter.on_device(target)
    if isinstance(target, (str, torch.device)):
        return _names_the_device(target)
    return from_device  # .to(dtype): stays where it is


class _FunctionMode(TorchFunctionMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_RESULTS:
            return func(*args, **kwargs)
        counter = self.counter
        inputs = _tensors((args, kwargs))
        from_device = any(counter.on_device(t) for t in inputs)
        if func is torch.Tensor.to:
            to_device = _destination(counter, args, kwargs, from_device)
            if from_device and not to_device:
                counter.count("to('cpu')")
            elif to_device and not from_device and not _non_blocking(args, kwargs):
                counter.count("copy to the device")
            out = func(*args, **kwargs)
            if out is args[0] and counter.on_device(out) != to_device:
                # a copy on CUDA; on the CPU the tensor itself, which keeps its place
                out = out.clone()
            if to_device:
                counter.mark(out)
            return out
        to_host = _TO_HOST.get(func)
        if to_host is not None:
            if counter.on_device(args[0]):
                counter.count(to_host)
            out = func(*args, **kwargs)
            if out is args[0]:  # .cpu() of a CPU tensor: a copy on CUDA
                out = out.clone()
            return out
        made_there = func in _FACTORIES and _names_the_device(kwargs.get("device"))
        if made_there and func in _COPIED_FACTORIES and not from_device:
            counter.count("copy to the device")  # the data is the host's
        out = func(*args, **kwargs)
        if from_device or made_there:
            counter.mark(out)
        return out


class _DispatchMode(TorchDispatchMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        kind = _ALWAYS.get(func)
        if kind is None and func in _WITH_BOOL_INDEX:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                kind = _WITH_BOOL_INDEX[func]
        if kind is not None and any(counter.on_device(t) for t in _tensors((args, kwargs))):
            counter.count(kind)
        return func(*args, **kwargs)


def per_iteration(counter: SyncCounter, generator, monkeypatch):
    """Hook ``generator`` (a DraftVerifyGenerator) so that ``counter`` records the count of each
    engine iteration: returns ``(iterations, batches)``, lists filled as ``generate`` runs, of
    the counts per iteration (from one draft step to the next, or to the end of the batch) and
    of the counts outside the iterations per batch (encoding, starting the drafter, finishing).
    The batch's tensors are marked as device tensors, and so are the encoder's and the
    verification's outputs (the fast step's native kernels make them outside torch).
    """
    import functools

    iterations, batches = [], []
    state = {"start": 0, "in_iteration": False, "first": 0}

    def close_iteration():
        if state["in_iteration"]:
            iterations.append(counter.total - state["start"])
            state["in_iteration"] = False

    from fairseq_pardec.decoding.draft_verify import iteration

    choose, draft, verify = generator._step_and_encoder, iteration.draft, iteration.verify
    generate = generator._generate

    @functools.wraps(generate)
    def _generate(sample, *args, **kwargs):
        counter.mark(sample)
        counter.mark_module(generator.model)
        before = counter.total
        state["in_iteration"], state["first"] = False, len(iterations)
        out = generate(sample, *args, **kwargs)
        close_iteration()
        batches.append(counter.total - before - sum(iterations[state["first"]:]))
        return out

    def _step_and_encoder():
        step, encode = choose()

        def encode_marked(net_input):
            out = encode(net_input)
            counter.mark(out)
            return out

        return step, encode_marked

    @functools.wraps(draft)
    def _draft(of, batch):
        if of is generator:
            close_iteration()
            state["start"], state["in_iteration"] = counter.total, True
        return draft(of, batch)

    @functools.wraps(verify)
    def _verify(of, batch, block):
        out = verify(of, batch, block)
        if of is generator:
            counter.mark(out)
        return out

    generator._generate, generator._step_and_encoder = _generate, _step_and_encoder
    monkeypatch.setattr(iteration, "draft", _draft)
    monkeypatch.setattr(iteration, "verify", _verify)
    return iterations, batches
