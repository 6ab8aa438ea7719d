"""Has any weight changed since the fast layouts were built? A key that answers exactly, cheaply.

The fast step, the fast encoder and the output projections keep weights in layouts of their own
(transposed, packed for oneDNN, in panels for the native kernel, fused and pre-scaled). They look
once per batch whether those copies still hold the model's weights, and at batch 1 that look must
cost next to nothing. Reading every weight once per batch (a checksum, which would not even see
every change: a float sum absorbs small ones) costs about ten times the key below, and several
percent of a sentence (docs/results.md). So nothing is read from the weights. A
:class:`WeightsKey` is built from what torch records of every write, and from the one write path
torch does not record, which it watches:

* ``data_ptr()``: a parameter replaced on its module (its owner's ``_parameters`` is read, not a
  parameter object kept from before), or given new storage (``.to(dtype)``, ``.half()``,
  ``.double()``, ``load_state_dict(..., assign=True)``). The layouts keep the storage they were
  built from alive (:meth:`WeightsKey.hold`), so a new storage can never reuse the old address
  (a ``.half()`` then ``.float()`` round trip would otherwise often land on it).
* ``_version``, the version counter that every in-place operation on the parameter bumps, on the
  parameter itself, on any view of it, and on every alias made by ``detach()`` (they share the
  counter): ``load_state_dict`` (``param.copy_`` under ``no_grad``), every ``torch.optim``
  optimizer, ``state_dict()`` tensors updated in place (fairseq's EMA, torch's
  ``AveragedModel``), ``with torch.no_grad(): p.mul_(...)``.
* ``p.data``: the one alias with a counter of its own, so writes through it move nothing above.
  fairseq's own optimizers write that way (``p_data_fp32 = p.data; p_data_fp32.addcdiv_(...)``
  in ``fairseq/optim/adam.py``), and so do many EMA and averaging loops
  (``ema.data.mul_(d).add_(p.data, alpha=1 - d)``). A parameter under a key is watched: its
  class becomes a subclass of its own (:func:`watch`) whose ``data`` property counts every read
  and assignment and keeps a weak reference to each alias it hands out. The key holds the count
  and the version of every alias still alive, so a write through ``p.data`` is seen whether the
  alias was taken before or after the last look. Reading ``p.data`` without writing also counts:
  such a read (printing a parameter, ``torch.save`` of a whole module) costs one rebuild, never
  a stale weight.

Not seen (the user documentation says so too): writes through memory torch hands out
without a version counter, ``p.numpy()`` / ``p.detach().numpy()`` arrays, ``untyped_storage()``,
DLPack exports and raw ``data_ptr()`` writes; writes through a ``p.data`` alias taken before
the parameter was first watched (before the first generator on the model was built) and kept;
and a submodule replaced inside the layers after the generator was built
(``decoder.layers[0].fc1 = nn.Linear(...)``). After such a write, build the generator again (or
call ``model.load_state_dict(model.state_dict())``, which bumps every version).

A watched parameter is still an ``nn.Parameter`` for everything else (``isinstance``,
optimizers, ``state_dict``, ``deepcopy``); ``torch.save`` of a whole module pickles it as a
plain ``Parameter``. Walking a module tree with ``parameters()`` on every look would cost more
than the look itself, so the tree is walked once; a look reads each parameter through its owner,
its storage address, its version and its watch record.

:data:`PREPARE_LOCK` serialises the rebuilds of every layout in the process (rare: first batch
and after a change), so that two threads starting together build one layout, measure the
kernels once (products.KernelChoice, shared by a step and its encoder) and never see half of
one.
"""

import threading
import weakref
from typing import Dict, Iterable, List, Tuple, Union

import torch

# held by whoever rebuilds a layout (re-entrant: a step builds its projection inside)
PREPARE_LOCK = threading.RLock()

_TENSOR_DATA = torch._C.TensorBase.data  # the getset descriptor every tensor's ``data`` is


class _Watch:
    """What a watched parameter's ``data`` property has done: ``reads`` (reads and assignments)
    and weak references to the aliases it handed out that may still be alive."""

    __slots__ = ("reads", "aliases")

    def __init__(self):
        self.reads = 0
        self.aliases: List[weakref.ref] = []

    def alias_versions(self) -> tuple:
        """The versions of the aliases still alive."""
        if not self.aliases:
            return ()
        return tuple(a._version for a in (ref() for ref in self.aliases) if a is not None)

    def add_alias(self, alias: torch.Tensor):
        # only here is the list replaced (dead references dropped: an optimizer makes an
        # alias per step), so a look, which only reads it, never loses one
        aliases = self.aliases
        if len(aliases) >= 8:
            aliases = [ref for ref in aliases if ref() is not None]
        self.aliases = aliases + [weakref.ref(alias)]


# id(parameter) -> its record; an entry leaves when its parameter is freed (weakref.finalize),
# before the id can be reused
_WATCHES: Dict[int, _Watch] = {}
_WATCH_LOCK = threading.Lock()
_WATCHED_CLASSES: Dict[type, type] = {}


def _get_data(self):
    data = _TENSOR_DATA.__get__(self)
    watch = _WATCHES.get(id(self))
    if watch is not None:
        watch.reads += 1
        watch.add_alias(data)
    return data


def _set_data(self, value):
    _TENSOR_DATA.__set__(self, value)
    watch = _WATCHES.get(id(self))
    if watch is not None:
        watch.reads += 1


def _watched_class(cls: type) -> type:
    """``cls`` with a ``data`` property that tells the parameter's watch record."""
    if getattr(cls, "_pardec_watched", False):
        return cls
    with _WATCH_LOCK:
        watched = _WATCHED_CLASSES.get(cls)
        if watched is None:
            watched = _WATCHED_CLASSES[cls] = type(cls.__name__, (cls,), {
                "data": property(_get_data, _set_data, doc=_TENSOR_DATA.__doc__),
                "_pardec_watched": True,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
            })
    return watched


def watch(parameter: torch.nn.Parameter) -> _Watch:
    """Start watching ``parameter``'s ``data`` (idempotent); its record."""
    watched = _WATCHES.get(id(parameter))
    if watched is not None:
        return watched
    with _WATCH_LOCK:
        watched = _WATCHES.get(id(parameter))
        if watched is None:
            watched = _WATCHES[id(parameter)] = _Watch()
            weakref.finalize(parameter, _WATCHES.pop, id(parameter), None)
    cls = _watched_class(type(parameter))
    if type(parameter) is not cls:
        parameter.__class__ = cls
    return watched


Modules = Union[torch.nn.Module, Iterable[torch.nn.Module]]


class WeightsKey:
    """``key()``: a tuple that changes whenever a parameter of ``modules`` may have changed
    (see the module's docstring for exactly what that covers); ``hold()``: what a layout built
    from the current weights keeps, so that the key stays exact while it lives."""

    def __init__(self, modules: Modules):
        if isinstance(modules, torch.nn.Module):
            modules = [modules]
        self._owners: List[Tuple[dict, str]] = [
            (owner._parameters, name)
            for module in modules
            for owner in module.modules()
            for name, parameter in owner._parameters.items() if parameter is not None
        ]
        for params, name in self._owners:
            if isinstance(params[name], torch.nn.Parameter):
                watch(params[name])

    def _parameters(self):
        return [params[name] for params, name in self._owners]

    def key(self) -> tuple:
        key = []
        for p in self._parameters():
            if p is None:
                key.append(None)
                continue
            watched = _WATCHES.get(id(p))
            if watched is None and isinstance(p, torch.nn.Parameter):
                watched = watch(p)  # a parameter put on its module since
            key.append((id(p), p.data_ptr(), p._version,
                        None if watched is None else (watched.reads, watched.alias_versions())))
        return tuple(key)

    def hold(self) -> list:
        """Aliases of the current parameters' storage (no copy): kept by a layout, they keep
        the storage's address from being reused by another tensor while the layout lives."""
        return [None if p is None else p.detach() for p in self._parameters()]
