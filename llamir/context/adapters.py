"""The adapters a context applies: llama_context's LoRA map (adapter -> scale) and its control vector.

set_adapters_lora keeps llama.cpp's rules: a scale of 0 leaves the adapter out, an adapter listed
twice keeps its first scale, and a call that changes nothing (the same adapters with the same
scales, zeros ignored) is no change, so the graphs stand. The products are added in llama.cpp's
order: its std::unordered_map lists two adapters in the reverse of their insertion, so llamir adds
them in the reverse of the order given (with three or more, llama.cpp's order depends on the
adapters' addresses, and sums may differ from it by rounding).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from llamir.frontend.adapter import AdapterError, AdapterSet, ControlVector, LoraAdapter
from llamir.frontend.gguf_file import GGUFTensor


class ContextAdapters:
    """One context's LoRA adapters (insertion order) and control vector."""

    def __init__(self, model):
        self.model = model
        self.loras: dict[LoraAdapter, float] = {}
        self.cvec = ControlVector()

    def set_loras(self, adapters: Sequence[LoraAdapter], scales: Sequence[float]) -> bool:
        """llama_context::set_adapters_lora; True when the set changed. AdapterError (nothing
        changed) for an adapter of another model or lists of different lengths."""
        adapters, scales = list(adapters), [np.float32(s) for s in scales]
        if len(adapters) != len(scales):
            raise AdapterError(f"set_adapters_lora: {len(adapters)} adapters but {len(scales)} scales")
        for i, adapter in enumerate(adapters):
            if not isinstance(adapter, LoraAdapter):
                raise AdapterError(f"set_adapters_lora: adapters[{i}] is a {type(adapter).__name__}, not a "
                                   "LoraAdapter (from llamir.load_adapter_lora)")
            if adapter.model is not self.model:
                raise AdapterError(f"set_adapters_lora: adapters[{i}] ({adapter.path}) was loaded for another model")
        if self._same(adapters, scales):
            return False
        loras: dict[LoraAdapter, float] = {}
        for adapter, scale in zip(adapters, scales, strict=True):
            if scale != 0 and adapter not in loras:
                loras[adapter] = float(scale)
        self.loras = loras
        return True

    def _same(self, adapters: list[LoraAdapter], scales: list[np.float32]) -> bool:
        """adapters_lora_are_same: every non-zero (adapter, scale) is in the map, and there are as
        many as the map holds."""
        nonzero = [(a, s) for a, s in zip(adapters, scales, strict=True) if s != 0]
        return all(self.loras.get(a) == s for a, s in nonzero) and len(nonzero) == len(self.loras)

    def set_cvec(self, data, n_embd: int, il_start: int, il_end: int) -> None:
        """llama_adapter_cvec::apply (see ControlVector.applied)."""
        values = None if data is None else np.asarray(data, dtype=np.float32)
        self.cvec = self.cvec.applied(self.model.hparams, values, n_embd, il_start, il_end)

    def graph_set(self) -> AdapterSet:
        """What a graph applies now: the adapters in adding order, the control vector's layers."""
        return AdapterSet(tuple(reversed(self.loras.items())), self.cvec.layers())

    def tensors(self) -> dict[str, GGUFTensor]:
        """The graph leaves of the active adapters and control vector, by name."""
        out: dict[str, GGUFTensor] = {}
        for adapter in self.loras:
            out.update(adapter.tensors())
        out.update(self.cvec.tensors())
        return out


__all__ = ["ContextAdapters"]
