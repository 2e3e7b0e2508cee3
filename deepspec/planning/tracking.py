"""Measured memory of a training step on any device (CPU included): live tensor bytes at their peak, by kind.

`TensorMemory` is a `TorchDispatchMode`: inside `with tracker.kind("forward"):` (and "backward", "optimizer") it
sees every tensor an operator returns, counts the bytes of each new storage under the current kind until the
storage is freed (a weak reference's callback), and keeps the largest total reached with that moment's split.
Gradients move to their own kind when autograd accumulates them into a watched parameter
(`watch_gradients`); tensors made outside it (parameters, the frozen target parts, the batch) are counted from
`track(kind, tensors)` on (an operator writing into them in place allocates nothing). Its peak is what
`torch.cuda.max_memory_allocated` reports on a GPU without the caching allocator's rounding. `SavedActivations`
splits what autograd keeps for backward by the region of the model that saved it, and `RssWatcher` polls what
the operating system saw (the resident set size: allocator caches, libraries and the Python heap included).

Shape legend: none.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Iterable
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

GRADIENTS = "gradients"


class TensorMemory(TorchDispatchMode):
    """Peak live tensor bytes of what runs inside its `kind(...)` blocks and of what it `track`s (module docstring)."""

    def __init__(self):
        super().__init__()
        self.live: dict[str, int] = defaultdict(int)
        self.peak_bytes = 0
        self.peak_by_kind: dict[str, int] = {}
        self._current = "forward"
        self._storages = WeakIdKeyDictionary()  # storage -> [bytes, kind, weakref keeping the callback alive]
        self._hooks = []

    @contextmanager
    def kind(self, name: str):
        """Count what is allocated inside the block as `name`."""
        previous, self._current = self._current, name
        try:
            with self:
                yield self
        finally:
            self._current = previous

    def watch_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Count the gradient of each parameter as `gradients` once autograd accumulated it."""
        for param in parameters:
            if param.requires_grad:
                self._hooks.append(param.register_post_accumulate_grad_hook(
                    lambda p: self.relabel(p.grad, GRADIENTS)))

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def track(self, kind: str, tensors: Iterable[torch.Tensor]) -> None:
        """Count `tensors` made outside the tracker (each storage once, until it is freed) as `kind`."""
        for tensor in tensors:
            self._add(tensor, kind)
        self._update_peak()

    def total_bytes(self) -> int:
        return sum(self.live.values())

    def _update_peak(self) -> None:
        total = self.total_bytes()
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.peak_by_kind = {k: v for k, v in self.live.items() if v}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._add(value, self._current)
        self._update_peak()
        return out

    def _add(self, tensor: torch.Tensor, kind: str) -> None:
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        if storage in self._storages or storage.nbytes() == 0:
            return
        info = [storage.nbytes(), kind, None]
        info[2] = weakref.ref(storage, lambda _, info=info: self._free(info))
        self._storages[storage] = info
        self.live[kind] += info[0]

    def _free(self, info: list) -> None:
        self.live[info[1]] -= info[0]

    def relabel(self, tensor: torch.Tensor | None, kind: str) -> None:
        """Count a tracked tensor's storage as `kind` from now on (nothing for an untracked one)."""
        if tensor is None:
            return
        info = self._storages.get(tensor.untyped_storage())
        if info is not None and info[1] != kind:
            self.live[info[1]] -= info[0]
            self.live[kind] += info[0]
            info[1] = kind


class SavedActivations:
    """Bytes autograd saves for backward during a forward, by the region of `model` that saved them.

    `regions` names the submodules that open a region (by their name in `model`); any other submodule belongs to
    the region it is called from, so a layer's projection called by the model's own code outside that layer counts
    there. The model's own forward is `root`, the code outside the model (the objective) `outside`. Each storage
    counts once, where it was first saved; the storages in `exclude` (parameters, the batch) never count."""

    def __init__(self, model: torch.nn.Module, regions: dict[str, str], root: str, outside: str,
                 exclude: Iterable[torch.Tensor] = ()):
        self.model, self.regions, self.root, self.outside = model, regions, root, outside
        self.bytes: dict[str, int] = defaultdict(int)
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude if t.device.type != "meta"}
        self._seen: set[int] = set()
        self._stack: list[str] = []
        self._handles = []
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _enter(self, name: str) -> None:
        region = self.root if name == "" else self.regions.get(name)
        self._stack.append(region or (self._stack[-1] if self._stack else self.root))

    def _leave(self) -> None:  # a forward hook returning a value would replace the module's output
        self._stack.pop()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in self._excluded and key not in self._seen:
                self._seen.add(key)
                self.bytes[self._stack[-1] if self._stack else self.outside] += storage.nbytes()
        return tensor

    def __enter__(self) -> "SavedActivations":
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(lambda m, a, n=name: self._enter(n)))
            self._handles.append(module.register_forward_hook(lambda m, a, o: self._leave()))
        self._saved_hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._saved_hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class RssWatcher:
    """Peak resident set size of this process while the `with` block runs (polled every `interval_s`)."""

    def __init__(self, interval_s: float = 0.05):
        import psutil

        self._process = psutil.Process()
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)
            time.sleep(self.interval_s)

    def __enter__(self) -> "RssWatcher":
        self.peak_bytes = self._process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a tensor shared or viewed twice counts once)."""
    seen, total = set(), 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), str(tensor.device))
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total
