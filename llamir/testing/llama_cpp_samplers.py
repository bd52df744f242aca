"""llama.cpp's own samplers as an oracle: libllama's llama_sampler_* through ctypes, declared here
against the vendored llama.h (not through llama-cpp-python's declarations, which may lag it).

    oracle = LlamaSamplers()
    h = oracle.new("top_k", 40)
    out = oracle.apply(h, TokenDataArray.from_logits(row))   # a new TokenDataArray
    oracle.close()
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, Structure, c_bool, c_char_p, c_double, c_float, c_int32, c_int64, c_size_t, c_uint32
from ctypes import c_void_p as SAMPLER

import numpy as np

from llamir.sampling import TokenDataArray


class TokenData(Structure):
    _fields_ = [("id", c_int32), ("logit", c_float), ("p", c_float)]


class TokenDataArrayC(Structure):
    _fields_ = [("data", POINTER(TokenData)), ("size", c_size_t), ("selected", c_int64), ("sorted", c_bool)]


class LogitBiasC(Structure):
    _fields_ = [("token", c_int32), ("bias", c_float)]


class ChainParams(Structure):
    _fields_ = [("no_perf", c_bool)]


class PerfSamplerData(Structure):
    _fields_ = [("t_sample_ms", c_double), ("n_sample", c_int32)]


_RECORD = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert _RECORD.itemsize == ctypes.sizeof(TokenData)

# llama_sampler_init_<name>: its parameters in llama.h's order
INIT_ARGS = {
    "greedy": [], "dist": [c_uint32], "top_k": [c_int32], "top_p": [c_float, c_size_t],
    "min_p": [c_float, c_size_t], "typical": [c_float, c_size_t], "temp": [c_float],
    "temp_ext": [c_float, c_float, c_float], "xtc": [c_float, c_float, c_size_t, c_uint32],
    "top_n_sigma": [c_float], "mirostat": [c_int32, c_uint32, c_float, c_float, c_int32],
    "mirostat_v2": [c_uint32, c_float, c_float],
    "penalties": [c_int32, c_int32, c_float, c_float, c_float],
    "dry": [SAMPLER, c_float, c_float, c_int32, c_int32, POINTER(c_char_p), c_size_t],
    "logit_bias": [c_int32, c_int32, POINTER(LogitBiasC)], "infill": [SAMPLER],
}


class LlamaSamplers:
    """libllama's sampler API. Handles are freed by close() (a chain frees what it holds)."""

    def __init__(self):
        from llamir.testing.llama_cpp import _lib

        _lib()                                    # backend initialised, logging silenced
        import llama_cpp.llama_cpp as bindings

        self.lib = bindings._lib
        self.fns: dict[str, object] = {}
        self._owned: list[int] = []
        self._models: list[int] = []
        sig = self._declare
        for name, args in INIT_ARGS.items():
            sig(f"llama_sampler_init_{name}", SAMPLER, *args)
        sig("llama_sampler_apply", None, SAMPLER, POINTER(TokenDataArrayC))
        sig("llama_sampler_accept", None, SAMPLER, c_int32)
        sig("llama_sampler_reset", None, SAMPLER)
        sig("llama_sampler_clone", SAMPLER, SAMPLER)
        sig("llama_sampler_free", None, SAMPLER)
        sig("llama_sampler_name", c_char_p, SAMPLER)
        sig("llama_sampler_get_seed", c_uint32, SAMPLER)
        sig("llama_sampler_chain_init", SAMPLER, ChainParams)
        sig("llama_sampler_chain_add", None, SAMPLER, SAMPLER)
        sig("llama_perf_sampler", PerfSamplerData, SAMPLER)
        sig("llama_model_get_vocab", SAMPLER, SAMPLER)
        sig("llama_model_free", None, SAMPLER)

    def _declare(self, name: str, restype, *argtypes) -> None:
        # a function object of its own: the library's cached one is shared with other declarations
        # (llama-cpp-python's, other tests'), whose argument types must not change under them
        fn = self.lib[name]
        fn.restype, fn.argtypes = restype, list(argtypes)
        self.fns[name] = fn

    def new(self, name: str, *args):
        """llama_sampler_init_<name>(*args), owned until close()."""
        if name == "logit_bias":
            n_vocab, biases = args
            arr = (LogitBiasC * len(biases))(*[LogitBiasC(t, b) for t, b in biases])
            args = (n_vocab, len(biases), arr)
        elif name == "dry":
            vocab, *rest, breakers = args
            arr = (c_char_p * len(breakers))(*[b.encode() if isinstance(b, str) else b for b in breakers])
            args = (vocab, *rest, arr, len(breakers))
        handle = self.fns[f"llama_sampler_init_{name}"](*args)
        assert handle, f"llama_sampler_init_{name}{args} returned NULL"
        self._owned.append(handle)
        return handle

    def chain(self, samplers, no_perf: bool = True):
        chain = self.fns["llama_sampler_chain_init"](ChainParams(no_perf))
        for s in samplers:
            self._owned.remove(s)
            self.fns["llama_sampler_chain_add"](chain, s)
        self._owned.append(chain)
        return chain

    def apply(self, handle, cur: TokenDataArray) -> TokenDataArray:
        """llama_sampler_apply on a copy of `cur`; the candidates it leaves, as a new array."""
        n = cur.size
        buf = (TokenData * max(n, 1))()
        rec = np.frombuffer(buf, dtype=_RECORD)[:n]
        rec["id"], rec["logit"], rec["p"] = cur.ids, cur.logits, cur.p
        arr = TokenDataArrayC(ctypes.cast(buf, POINTER(TokenData)), n, cur.selected, cur.sorted)
        self.fns["llama_sampler_apply"](handle, ctypes.byref(arr))
        start = (ctypes.cast(arr.data, SAMPLER).value - ctypes.addressof(buf)) // _RECORD.itemsize
        out = np.frombuffer(buf, dtype=_RECORD)[start:start + arr.size].copy()
        return TokenDataArray(out["id"], out["logit"], out["p"], int(arr.selected), bool(arr.sorted))

    def sample_logits(self, handle, row) -> int:
        """llama_sampler_sample without a context: apply to every token, accept the pick."""
        out = self.apply(handle, TokenDataArray.from_logits(row))
        token = out.selected_token
        self.fns["llama_sampler_accept"](handle, token)
        return token

    def clone(self, handle):
        twin = self.fns["llama_sampler_clone"](handle)
        self._owned.append(twin)
        return twin

    def __getattr__(self, name: str):
        fns = self.__dict__.get("fns", {})
        if f"llama_sampler_{name}" not in fns:
            raise AttributeError(name)
        return fns[f"llama_sampler_{name}"]

    def vocab(self, path) -> int:
        """The llama_vocab of a GGUF, loaded vocab-only (freed by close())."""
        import llama_cpp

        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        assert model, f"llama.cpp could not load {path}"
        model = ctypes.cast(model, SAMPLER).value
        self._models.append(model)
        return self.fns["llama_model_get_vocab"](model)

    def close(self) -> None:
        for h in self._owned:
            self.fns["llama_sampler_free"](h)
        for m in self._models:
            self.fns["llama_model_free"](m)
        self._owned.clear()
        self._models.clear()


__all__ = ["INIT_ARGS", "LlamaSamplers", "TokenData", "TokenDataArrayC"]
