"""Selective checkpointing's offload policies, honoured in eager mode.

A ``context_fn`` made by ``torch.utils.checkpoint.create_selective_checkpoint_contexts``
may answer ``CheckpointPolicy.MUST_CPU_OFFLOAD`` or ``PREFER_CPU_OFFLOAD``
for an op: "keep this op's output for backward, but on the host". torch's
eager checkpoint recomputes such ops (only torch.compile acts on the
policies). Under :func:`matepoint.checkpoint` the op's output is kept as
``MUST_SAVE`` would keep it, and sent through matepoint's offload engine
(pinned host pool, copy-out stream, window) wherever the engine offloads a
region's inputs: a CUDA tensor with offload enabled. It is copied back to
its device ahead of use, as the region's inputs are: with them when the
engine prefetches the region, or when the region's recompute begins, and
the recompute waits for the copy on the device, not on the host. Where
nothing can be offloaded (CPU tensors, offload turned off, tensors under
``min_offload_bytes``) the output stays where it is, exactly as with
``MUST_SAVE``. An offloaded output changed in place after it was offloaded
(later in the region, or by the caller after it, while the caller holds
it) raises when backward needs it, as torch's cache does, and even with
``allow_cache_entry_mutation=True``: its host copy no longer matches it.

Outputs of ops run after the last tensor the region saved for backward
(often a block's last matmul, whose output only a residual sum takes) are
let go when the region's forward ends, offloaded or not: the recompute
stops at that tensor, before those ops, so it never asks for them.

matepoint's checkpoint calls :func:`adapt` on the forward context before
the region runs, through the one callback this module registers with the C
core when the package is imported (``_C._set_sac_adapter``: the C core
never imports the package by name); nothing here is public.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._pytree import tree_leaves, tree_map

from matepoint import _C

__all__: List[str] = []

# The one table of the torch.utils.checkpoint names (most of them private)
# this adapter relies on, each looked up once, here. A name this torch lacks
# is listed in MISSING, which tests/test_torch_lookups.py holds empty on the
# torch versions CI runs, so a rename in torch fails a test. At run time a
# missing name with no entry in _OLDER_TORCH turns the adapter off with a
# warning: torch's own selective checkpointing then runs unchanged.
# (The caching mode's class, which the C core tests each region's forward
# context against, is in csrc/module/module.c's table: _C.TORCH_MISSING.)
_TORCH_NAMES = (
    "CheckpointPolicy.MUST_SAVE",
    "CheckpointPolicy.MUST_CPU_OFFLOAD",
    "CheckpointPolicy.PREFER_CPU_OFFLOAD",
    "_VersionWrapper",              # how torch's cache stores one tensor
    "_CachedTorchDispatchMode",     # torch's recompute mode
    "_sac_storage_key",             # the cache's key of an op
    "_is_compiling",                # under torch.compile the policies are torch's
    "SAC_IGNORED_OPS",              # ops the caching mode runs without storing
    "_RECOMPUTE",                   # its mark of an op stored as "recompute"
)
# what an older torch without the name did instead
_OLDER_TORCH: Dict[str, Any] = {
    "_sac_storage_key": lambda func, args: func,    # its cache was keyed by op alone
}


def _look_up(names: Tuple[str, ...]) -> Tuple[Dict[str, Any], Tuple[str, ...]]:
    """(name -> object, the names this torch lacks)."""
    found: Dict[str, Any] = {}
    missing: List[str] = []
    for dotted in names:
        value: Any = torch_checkpoint
        try:
            for part in dotted.split("."):
                value = getattr(value, part)
        except AttributeError:
            missing.append(dotted)
            value = _OLDER_TORCH.get(dotted)
        found[dotted] = value
    return found, tuple(missing)


_TORCH, MISSING = _look_up(_TORCH_NAMES)
# the missing names the adapter cannot do without
_UNUSABLE = tuple(name for name in MISSING if name not in _OLDER_TORCH)
_MUST_SAVE = _TORCH["CheckpointPolicy.MUST_SAVE"]
_OFFLOAD_POLICIES = frozenset(
    (_TORCH["CheckpointPolicy.MUST_CPU_OFFLOAD"], _TORCH["CheckpointPolicy.PREFER_CPU_OFFLOAD"]))
_VersionWrapper = _TORCH["_VersionWrapper"]
_CachedMode = _TORCH["_CachedTorchDispatchMode"]
_storage_key: Callable[[Any, Any], Any] = _TORCH["_sac_storage_key"]
_is_compiling: Callable[..., bool] = _TORCH["_is_compiling"]
_IGNORED_OPS = _TORCH["SAC_IGNORED_OPS"]
_RECOMPUTE = _TORCH["_RECOMPUTE"]
# set once _warn_unusable warned (read and written under the GIL)
_warned_unusable = False


class _OffloadedGroup:
    """The tensors of one op's output that went to the host: copied back
    ahead of the region's recompute (`prefetch`), handed back together the
    first time backward asks for one of them."""

    def __init__(self, group: Any, saved: List[Any], sources: List[torch.Tensor],
                 outputs: List[torch.Tensor]) -> None:
        self._group: Optional[Any] = group
        self._saved = saved
        self._restored: Optional[List[Optional[torch.Tensor]]] = None
        # the outputs and their versions, until the region's forward ends
        self._sources = [(tensor, tensor._version) for tensor in sources]
        self._mutated = False
        # the op's outputs as the caller sees them, watched without keeping
        # their memory: one changed in place after the region (as torch's
        # cache would notice) makes the host copy stale
        self._watched = [(weakref.ref(tensor), tensor._version) for tensor in outputs]

    def seal(self) -> None:
        """At the end of the region's forward: was an output changed in
        place after its copy was taken? The outputs are let go."""
        self._mutated = self._mutated or any(
            tensor._version != version for tensor, version in self._sources)
        self._sources = []

    def _changed(self) -> bool:
        if self._mutated:
            return True
        for ref, version in self._watched:
            tensor = ref()
            if tensor is not None and tensor._version != version:
                return True
        return False

    def prefetch(self) -> None:
        """Starts copying the host copies back (the recompute is about to
        need them)."""
        if self._group is not None and self._restored is None:
            _C._sac_prefetch(self._group)

    def discard(self) -> None:
        """The recompute is over: what it did not take is dropped from the
        device (the host copy stays)."""
        if self._group is not None:
            _C._sac_discard(self._group)

    def _release(self) -> None:
        if self._group is not None:
            _C._sac_discard(self._group)
        self._group = None
        self._saved = []

    def take(self, index: int) -> torch.Tensor:
        if self._restored is None and self._changed():
            self._release()     # nothing can use the host copy any more
            raise RuntimeError(
                "Tensor cached during selective activation checkpoint has been mutated: "
                "matepoint offloaded it to the host (CPU-offload policy) before it was "
                "changed in place, so backward cannot use it; clone it before changing "
                "it in place")
        if self._restored is None:
            if self._group is None:
                raise RuntimeError("matepoint: an offloaded selective-checkpoint output was "
                                   "already handed back")
            self._restored = _C._sac_restore(self._group, self._saved)
            self._group = None
            self._saved = []
            self._watched = []
        tensor = self._restored[index]
        self._restored[index] = None     # the cache entry holds nothing once used
        if tensor is None:
            raise RuntimeError("matepoint: an offloaded selective-checkpoint output was "
                               "already handed back")
        return tensor


class _OffloadedEntry:
    """Stands for one tensor in torch's selective-checkpoint storage, where a
    ``_VersionWrapper`` would stand: ``get_val`` restores it."""

    __slots__ = ("_owner", "_index")

    def __init__(self, owner: _OffloadedGroup, index: int) -> None:
        self._owner = owner
        self._index = index

    def get_val(self, allow_cache_entry_mutation: bool) -> torch.Tensor:
        # an offloaded output cannot be handed back changed: the host copy
        # predates the change (see _OffloadedGroup.seal)
        del allow_cache_entry_mutation
        return self._owner.take(self._index)


def _offloadable(leaf: Any) -> bool:
    return (type(leaf) is _VersionWrapper
            and isinstance(getattr(leaf, "val", None), torch.Tensor)
            and getattr(leaf, "unpack_hook", None) is None)


def _offload_entry(entry: Any, out: Any, groups: List[_OffloadedGroup]) -> Any:
    """The storage entry of a saved op output `out`, its tensors offloaded
    (their group appended to `groups`); the entry itself when nothing could
    move."""
    leaves: List[Any] = []
    outputs: List[torch.Tensor] = []
    # torch's entry is `out` with each leaf wrapped: the leaves pair up
    paired = zip(tree_leaves(entry), tree_leaves(out))
    for leaf, output in paired:
        if _offloadable(leaf):
            leaves.append(leaf)
            outputs.append(output if isinstance(output, torch.Tensor) else leaf.val)
    if not leaves:
        return entry
    sources = [leaf.val for leaf in leaves]
    # the engine's window counts regions, not ops: the region's first
    # outputs say so
    moved: Optional[Tuple[Any, List[Any]]] = _C._sac_offload(sources, not groups)
    if moved is None:
        return entry
    owner = _OffloadedGroup(moved[0], moved[1], sources, outputs)
    groups.append(owner)
    slots: Dict[int, _OffloadedEntry] = {
        id(leaf): _OffloadedEntry(owner, i)
        for i, leaf in enumerate(leaves) if moved[1][i] is not None}
    return tree_map(lambda leaf: slots.get(id(leaf), leaf), entry)


class _OffloadPolicies:
    """Wraps the user's policy: an offload answer becomes MUST_SAVE for
    torch's caching mode, remembered for the op being dispatched."""

    def __init__(self, policy_fn: Callable[..., Any]) -> None:
        self.policy_fn = policy_fn
        self.translate = True
        self.offload = False

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        policy = self.policy_fn(ctx, func, *args, **kwargs)
        if self.translate and policy in _OFFLOAD_POLICIES:
            self.offload = True
            return _MUST_SAVE
        return policy


class _Unreached:
    """Stands, in torch's selective-checkpoint storage, for an output the
    recompute never reaches: the op ran after the last tensor the region
    saved, where an early-stopping recompute ends."""

    __slots__ = ()

    def get_val(self, allow_cache_entry_mutation: bool) -> torch.Tensor:
        del allow_cache_entry_mutation
        raise RuntimeError(
            "matepoint: the recompute reached an op run after the last tensor the region "
            "saved, whose selective-checkpoint output was let go when the forward ended; "
            "this is a bug in matepoint, please report it")


_UNREACHED = _Unreached()


class _OffloadingMode:
    """Mixed into torch's caching mode (or a subclass of it): after torch
    stored an op's output, one its policy offloads goes to the host; and
    when the forward ends, the outputs of the ops run after the region's
    last saved tensor are let go (the early-stopping recompute stops at that
    tensor, so it never asks for them: torch would hold them until the
    region's backward)."""

    policy_fn: _OffloadPolicies
    storage: Any
    func_counter: Any
    _matepoint_offloaded: List[_OffloadedGroup]
    _matepoint_frame: Any           # the region's frame while tails are tracked, else None
    _matepoint_tail: List[Tuple[Any, int]]   # storage slots filled since the last save
    _matepoint_tail_saved: int      # the frame's saved count when the tail began

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        policies = self.policy_fn
        policies.offload = False
        policies.translate = not _is_compiling(func, args, kwargs or {})
        frame = self._matepoint_frame if policies.translate else None
        if frame is not None and frame._saved_count != self._matepoint_tail_saved:
            self._matepoint_tail_saved = frame._saved_count
            self._matepoint_tail = []
        out = super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[misc]
        if func in _IGNORED_OPS or not (policies.offload or frame is not None):
            return out
        key = _storage_key(func, args)
        index = self.func_counter[key] - 1
        if frame is not None:
            self._matepoint_tail.append((key, index))
        if policies.offload:
            policies.offload = False
            self.storage[key][index] = _offload_entry(self.storage[key][index], out,
                                                      self._matepoint_offloaded)
        return out

    def _drop_unreached(self) -> None:
        dropped: List[_OffloadedGroup] = []
        for key, index in self._matepoint_tail:
            entries = self.storage.get(key)
            entry = entries.get(index) if entries is not None else None
            if entry is None or entry is _RECOMPUTE:
                continue
            for leaf in tree_leaves(entry):
                if isinstance(leaf, _OffloadedEntry):
                    dropped.append(leaf._owner)
            entries[index] = _UNREACHED
        for group in dropped:
            group._release()
        # the list is shared with the recompute mode, which prefetches it
        self._matepoint_offloaded[:] = [
            group for group in self._matepoint_offloaded
            if not any(group is gone for gone in dropped)]
        self._matepoint_tail = []

    def __exit__(self, *exc_info: Any) -> Any:
        frame, self._matepoint_frame = self._matepoint_frame, None
        if frame is not None and exc_info[0] is None and \
                frame._saved_count == self._matepoint_tail_saved:
            self._drop_unreached()
        for group in self._matepoint_offloaded:
            group.seal()
        return super().__exit__(*exc_info)  # type: ignore[misc]


class _PrefetchingMode:
    """Mixed into torch's recompute mode: the region's offloaded outputs
    start coming back when its recompute begins (unless the engine fetched
    them with the region already), and what it did not take leaves the
    device when it ends (an early stop skips the ops after the last saved
    tensor)."""

    _matepoint_offloaded: List[_OffloadedGroup]

    def __enter__(self) -> Any:
        # before the mode is pushed: the copies' device buffers are made by
        # torch ops, which the mode must not see
        for group in self._matepoint_offloaded:
            group.prefetch()
        return super().__enter__()  # type: ignore[misc]

    def __exit__(self, *exc_info: Any) -> Any:
        try:
            return super().__exit__(*exc_info)  # type: ignore[misc]
        finally:
            for group in self._matepoint_offloaded:
                group.discard()


_adapted: Dict[Tuple[type, type], type] = {}


def _adapt_class(mode: Any, mixin: type) -> None:
    cls = type(mode)
    adapted = _adapted.get((mixin, cls))
    if adapted is None:
        adapted = type(cls.__name__, (mixin, cls), {"__module__": __name__})
        _adapted[(mixin, cls)] = adapted
    mode.__class__ = adapted


def adapt(mode: Any, recompute: Any = None, frame: Any = None) -> None:
    """Makes torch's selective-checkpoint caching mode ``mode`` honour
    offload policies and let go of what the recompute of ``frame`` (the
    region's checkpoint frame, when given) will not reach (in place: its
    class and policy_fn change), and its recompute mode ``recompute``
    (torch's cached mode, when given) prefetch what ``mode`` offloaded.
    On a torch without a name the adapter needs (MISSING) it leaves both
    modes as they are and warns once."""
    if _UNUSABLE:
        _warn_unusable()
        return
    if isinstance(mode, _OffloadingMode):
        return
    groups: List[_OffloadedGroup] = []
    mode.policy_fn = _OffloadPolicies(mode.policy_fn)
    mode._matepoint_offloaded = groups
    mode._matepoint_frame = frame if frame is not None and frame._early_stop else None
    mode._matepoint_tail = []
    mode._matepoint_tail_saved = -1
    _adapt_class(mode, _OffloadingMode)
    if isinstance(recompute, _CachedMode) and not isinstance(recompute, _PrefetchingMode):
        recompute._matepoint_offloaded = groups
        _adapt_class(recompute, _PrefetchingMode)


def _warn_unusable() -> None:
    global _warned_unusable
    if _warned_unusable:
        return
    _warned_unusable = True
    warnings.warn(
        "matepoint: this torch's torch.utils.checkpoint lacks " + ", ".join(_UNUSABLE) +
        ", which matepoint's selective checkpointing relies on: CPU-offload policies are "
        "recomputed as torch's eager checkpoint does, and nothing is let go early. "
        "Upgrade matepoint, or report it", RuntimeWarning, stacklevel=3)


_C._set_sac_adapter(adapt)
