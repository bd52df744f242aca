"""LoRA adapters and control vectors, as llama.cpp loads and applies them (src/llama-adapter.cpp,
common/common.cpp).

    adapter = load_adapter_lora(model, "lora.gguf")        # llama_adapter_lora_init
    ctx.set_adapters_lora([adapter], [1.0])                  # llama_set_adapters_lora
    n_embd, data = load_control_vectors([("cvec.gguf", 1.0)])   # common_control_vector_load
    ctx.set_adapter_cvec(data, n_embd, 1, n_layer)           # llama_set_adapter_cvec

A LoRA file is a GGUF with general.type = adapter, adapter.type = lora, the base model's
general.architecture, adapter.lora.alpha (f32, 0 when absent) and, for each adapted weight W, the
pair W.lora_a / W.lora_b. An adapted matmul is W x + s * B (A x) with s = scale * alpha / rank
(s = scale when alpha is 0), rank being B's inner size. Every check llama.cpp makes is made here,
with an error that names the file and the tensor; where llama.cpp would only fail later, inside
ggml (a pair whose ranks or expert counts disagree), the file is refused at load instead.

A control vector file holds direction.{il} f32 vectors [n_embd] (il >= 1); a context adds the
vector of layer il to the output of block il for il in [il_start, il_end].
"""

from __future__ import annotations

import itertools
import re
from collections import ChainMap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from llamir.frontend.gguf_file import GGUFError, GGUFFile, GGUFTensor
from llamir.frontend.gguf_meta import GGUFType, ValueType
from llamir.ir import F32


class AdapterError(ValueError):
    """A LoRA or control vector file (or call) that llama.cpp refuses; the message says why."""


_SERIAL = itertools.count()


@dataclass(frozen=True, eq=False)
class LoraWeight:
    """One adapted weight's pair: a [rank, n_in] and b [n_out, rank] in numpy order ([E, ...] for
    experts); for token_embd, a [n_vocab, rank] and b [n_embd, rank] (the embedding rows pick a's)."""

    base: str
    a: GGUFTensor
    b: GGUFTensor

    @property
    def rank(self) -> int:
        return self.b.shape[-1]   # b->ne[0]

    def scale(self, alpha: float, adapter_scale: float) -> float:
        """llama_adapter_lora_weight::get_scale: adapter_scale * alpha / rank (in f32), or
        adapter_scale when alpha is 0."""
        s, a = np.float32(adapter_scale), np.float32(alpha)
        return float(s * a / np.float32(self.rank)) if a else float(s)


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """llama_adapter_lora: the pairs by base tensor name, alpha, the scalar metadata as strings and
    the aLoRA invocation tokens. Compared by identity, as llama.cpp compares adapter pointers."""

    model: object
    path: Path
    alpha: float
    weights: Mapping[str, LoraWeight]
    meta: Mapping[str, str]
    alora_invocation_tokens: tuple[int, ...] = ()
    tag: str = field(default_factory=lambda: f"lora{next(_SERIAL)}")

    def get_weight(self, name: str | None) -> LoraWeight | None:
        return self.weights.get(name) if name else None

    def leaf_name(self, lw: LoraWeight, part: str) -> str:
        """The graph leaf of lw's a or b: unique to this adapter (two adapters may pair one weight)."""
        return f"{self.tag}.{lw.base}.lora_{part}"

    def tensors(self) -> dict[str, GGUFTensor]:
        """Every a and b tensor by its graph leaf name."""
        return {self.leaf_name(lw, part): getattr(lw, part) for lw in self.weights.values() for part in "ab"}

    def meta_val_str(self, key: str) -> str | None:
        """llama_adapter_meta_val_str: a scalar metadata value as llama.cpp prints it (None: absent)."""
        return self.meta.get(key)

    def __repr__(self) -> str:
        return f"<LoraAdapter {self.tag} {self.path.name} alpha={self.alpha} pairs={len(self.weights)}>"


def load_adapter_lora(model, path: str | Path) -> LoraAdapter:
    """llama_adapter_lora_init: the LoRA file at `path`, checked against `model`; AdapterError
    when llama.cpp would refuse it."""
    path = Path(path)
    try:
        f = GGUFFile(path)
    except GGUFError as err:
        raise AdapterError(f"failed to load lora adapter from file: {err}") from None
    try:
        alpha, alora = _check_metadata(f, model)
    except GGUFError as err:   # a key of the wrong type (llama.cpp's gguf getters abort on it)
        raise AdapterError(str(err)) from None
    pairs = _pairs(f)
    weights = {name: _checked_pair(path, model, name, a, b) for name, (a, b) in sorted(pairs.items())}
    meta = {key: _kv_to_str(f.metadata[key], f.metadata.value_type(key)) for key in f.metadata
            if f.metadata.value_type(key).type != GGUFType.ARRAY}
    return LoraAdapter(model, path, alpha, weights, meta, alora)


def _check_metadata(f: GGUFFile, model) -> tuple[float, tuple[int, ...]]:
    """general.type, the architecture, adapter.type, alpha and the aLoRA tokens, in llama.cpp's order."""
    meta, path = f.metadata, f.path
    general_type = meta.get_str("general.type", "")
    if general_type != "adapter":
        raise AdapterError(f"{path}: expect general.type to be 'adapter', but got: {general_type!r}")
    arch = meta.get_str("general.architecture", "")
    if arch != model.hparams.arch:
        raise AdapterError(f"{path}: model arch and LoRA arch mismatch: the model is {model.hparams.arch!r}, "
                           f"the adapter {arch!r}")
    adapter_type = meta.get_str("adapter.type", "")
    if adapter_type != "lora":
        raise AdapterError(f"{path}: expect adapter.type to be 'lora', but got: {adapter_type!r}")
    alpha = meta.get_f32("adapter.lora.alpha", 0.0)
    key = "adapter.alora.invocation_tokens"
    if key not in meta:
        return alpha, ()
    vtype = meta.value_type(key)
    if vtype.type != GGUFType.ARRAY:
        raise AdapterError(f"{path}: invalid gguf type for {key}: {vtype}, expected an array of u32")
    if vtype.item != GGUFType.UINT32:
        raise AdapterError(f"{path}: invalid gguf element type for {key}: {vtype}, expected arr[u32]")
    return alpha, tuple(int(t) for t in np.asarray(meta[key], dtype=np.uint32).astype(np.int32))


def _pairs(f: GGUFFile) -> dict[str, list[GGUFTensor | None]]:
    """Base name -> [lora_a, lora_b] (a part may be missing); *_norm.weight tensors are skipped,
    as llama.cpp skips them; any other name is refused."""
    pairs: dict[str, list[GGUFTensor | None]] = {}
    for name, tensor in f.tensors.items():
        for i, suffix in enumerate((".lora_a", ".lora_b")):
            if name.endswith(suffix):
                pairs.setdefault(name.replace(suffix, ""), [None, None])[i] = tensor
                break
        else:
            if not name.endswith("_norm.weight"):
                raise AdapterError(f"{f.path}: LoRA tensor {name!r} has unexpected suffix "
                                   "(expected .lora_a or .lora_b)")
    return pairs


def _checked_pair(path: Path, model, name: str, a: GGUFTensor | None, b: GGUFTensor | None) -> LoraWeight:
    """llama.cpp's checks of one pair against its base tensor (in ggml's ne[] terms, shown here in
    numpy order): both parts there, the base in the model, a's input and b's output sizes the
    base's, a's rank b's; and (where ggml would fail later) matching expert counts and a rank of
    the base's."""
    missing = [part for part, t in (("lora_a", a), ("lora_b", b)) if t is None]
    if missing:
        raise AdapterError(f"{path}: LoRA tensor pair for {name!r} is missing one component: {name}.{missing[0]}")
    if not model.has_tensor(name):
        raise AdapterError(f"{path}: LoRA tensor {name!r} does not exist in base model (hint: maybe wrong base "
                           "model?)")
    for t in (a, b):
        if t.dtype.is_int:
            raise AdapterError(f"{path}: LoRA tensor {t.name!r} is {t.dtype}; a LoRA matrix must be float or "
                               "quantized")
    base = model.tensor(name)
    if name.endswith("token_embd.weight"):   # a is [n_vocab, rank] (flipped): its rows are picked
        w_ne, a_ne, b_ne = _ne(base.shape), _ne(a.shape), _ne(b.shape)
        if w_ne[0] != b_ne[1] or w_ne[1] != a_ne[1]:
            raise _shape_error(path, name, base, a, b, f"[{base.shape[0]}, rank]", f"[{base.shape[1]}, rank]")
        if a_ne[0] != b_ne[0]:
            raise AdapterError(f"{path}: tensor {name!r}: lora_a {list(a.shape)} and lora_b {list(b.shape)} "
                               "have different ranks")
        return LoraWeight(name, a, b)
    w_ne, a_ne, b_ne = _ne(base.shape), _ne(a.shape), _ne(b.shape)
    if w_ne[0] != a_ne[0] or w_ne[1] != b_ne[1]:
        n_out = base.shape[-2] if len(base.shape) > 1 else 1
        raise _shape_error(path, name, base, a, b, f"[rank, {base.shape[-1]}]", f"[{n_out}, rank]")
    if a_ne[1] != b_ne[0]:
        raise AdapterError(f"{path}: tensor {name!r}: lora_a tensor is not transposed (hint: adapter from "
                           f"\"finetune\" example is no longer supported): lora_a {list(a.shape)}, lora_b "
                           f"{list(b.shape)}, a's rows must be b's columns")
    n_expert = w_ne[2] if len(base.shape) == 3 else 1
    if (len(base.shape) == 3 or len(a.shape) > 2 or len(b.shape) > 2) and not a_ne[2] == b_ne[2] == n_expert:
        raise AdapterError(f"{path}: tensor {name!r} [{', '.join(map(str, base.shape))}] has {n_expert} "
                           f"expert(s), but lora_a is {list(a.shape)} and lora_b {list(b.shape)}")
    return LoraWeight(name, a, b)


def _ne(shape: tuple[int, ...]) -> tuple[int, ...]:
    """ggml's ne[] of a numpy-order shape, padded with 1s to 4 dims."""
    return tuple(reversed(shape)) + (1,) * (4 - len(shape))


def _shape_error(path: Path, name: str, base: GGUFTensor, a: GGUFTensor, b: GGUFTensor, want_a: str,
                 want_b: str) -> AdapterError:
    return AdapterError(f"{path}: tensor {name!r} has incorrect shape (hint: maybe wrong base model?): the base "
                        f"is {list(base.shape)}, so lora_a must be {want_a} and lora_b {want_b}; the file has "
                        f"lora_a {list(a.shape)} and lora_b {list(b.shape)}")


def _kv_to_str(value, vtype: ValueType) -> str:
    """gguf_kv_to_str of a scalar: strings as they are, numbers by std::to_string, bools true/false."""
    if vtype.type == GGUFType.STRING:
        return value
    if vtype.type == GGUFType.BOOL:
        return "true" if value else "false"
    if vtype.type in (GGUFType.FLOAT32, GGUFType.FLOAT64):
        return f"{float(value):f}"
    return str(int(value))


# -- the adapters a graph is built with ----------------------------------------------------------
@dataclass(frozen=True)
class AdapterSet:
    """What a graph applies: the LoRA adapters with their scales, in the order their products are
    added (llama.cpp's iteration order of its adapter map), and the layers whose output gets the
    control vector. Part of GraphConfig: another set is another graph."""

    loras: tuple[tuple[LoraAdapter, float], ...] = ()
    cvec_layers: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.loras or self.cvec_layers)

    def pairs_for(self, name: str | None) -> list[tuple[LoraAdapter, LoraWeight, float]]:
        """(adapter, pair, f32 scale) of each adapter that pairs weight `name`, in adding order."""
        out = []
        for adapter, scale in self.loras:
            lw = adapter.get_weight(name)
            if lw is not None:
                out.append((adapter, lw, lw.scale(adapter.alpha, scale)))
        return out


def cvec_leaf_name(il: int) -> str:
    """The graph leaf of layer il's control vector."""
    return f"cvec.{il}"


@dataclass(frozen=True, eq=False)
class ControlVector:
    """llama_adapter_cvec: a direction per layer 1..n_layer-1 (zeros until set; there is none for
    layer 0) and the layer range [layer_start, layer_end] it applies to (-1, -1: off)."""

    directions: tuple[np.ndarray, ...] = ()   # empty until the first apply; index il
    layer_start: int = -1
    layer_end: int = -1

    def tensor_for(self, il: int) -> np.ndarray | None:
        if il < 0 or il < self.layer_start or il > self.layer_end or il >= len(self.directions) or il == 0:
            return None
        return self.directions[il]

    def layers(self) -> tuple[int, ...]:
        """The layers whose output gets a vector added."""
        return tuple(il for il in range(len(self.directions)) if self.tensor_for(il) is not None)

    def applied(self, hp, data: np.ndarray | None, n_embd: int, il_start: int, il_end: int) -> ControlVector:
        """llama_adapter_cvec::apply: None turns the vector off (its data kept); otherwise data holds
        n_embd floats per layer from layer 1 on, and a layer the data does not reach keeps what it
        had. AdapterError for an n_embd that is not the model's."""
        if data is None:
            return replace(self, layer_start=-1, layer_end=-1)
        if n_embd != hp.n_embd:
            raise AdapterError(f"control vector n_embd does not match model: {n_embd}, the model's is {hp.n_embd}")
        data = np.ascontiguousarray(data, dtype=np.float32).reshape(-1)
        directions = list(self.directions) or [np.zeros(0, np.float32)] + [
            np.zeros(n_embd, np.float32) for _ in range(1, hp.n_layer)]
        for il in range(1, hp.n_layer):
            off = n_embd * (il - 1)
            if off + n_embd <= data.size:
                directions[il] = data[off:off + n_embd].copy()
        return ControlVector(tuple(directions), il_start, il_end)

    def tensors(self) -> dict[str, GGUFTensor]:
        """The applied layers' vectors by graph leaf name."""
        return {cvec_leaf_name(il): GGUFTensor(cvec_leaf_name(il), F32, self.directions[il].shape,
                                                self.directions[il]) for il in self.layers()}


class AdaptedModel:
    """A model's tensors together with adapter tensors (by graph leaf name), as placement and the
    weight lookup read a model; everything else is the model's."""

    def __init__(self, model, extra: Mapping[str, GGUFTensor]):
        self.model = model
        self.tensors = ChainMap(dict(extra), model.tensors)

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> GGUFTensor:
        t = self.tensors.get(name)
        return t if t is not None else self.model.tensor(name)

    def weight_array(self, name: str) -> np.ndarray:
        t = self.tensors.maps[0].get(name)
        return t.data if t is not None else self.model.weight_array(name)


# -- control vector files (common_control_vector_load) -------------------------------------------
def load_control_vectors(files: Sequence[tuple[str | Path, float]]) -> tuple[int, np.ndarray]:
    """common_control_vector_load: (n_embd, data) with the files' directions times their strengths
    summed, layer il at data[n_embd * (il - 1):]; AdapterError for a file llama.cpp skips."""
    n_embd, data = -1, np.zeros(0, np.float32)
    for path, strength in files:
        cur_n, cur = _load_control_vector(Path(path), strength)
        if n_embd != -1 and cur_n != n_embd:
            raise AdapterError(f"{path}: control vectors in {path} does not match previous dimensions "
                               f"({cur_n} != {n_embd})")
        if n_embd == -1:
            n_embd, data = cur_n, cur
        else:
            total = np.zeros(max(data.size, cur.size), np.float32)
            total[:data.size] = data
            total[:cur.size] += cur
            data = total
    if n_embd == -1:
        raise AdapterError("no valid control vector files passed")
    return n_embd, data


def _load_control_vector(path: Path, strength: float) -> tuple[int, np.ndarray]:
    try:
        f = GGUFFile(path)
    except GGUFError as err:
        raise AdapterError(f"failed to load control vector file from {path}: {err}") from None
    if not f.tensors:
        raise AdapterError(f"{path}: no direction tensors found")
    n_embd, data, strength = -1, np.zeros(0, np.float32), np.float32(strength)
    for name, tensor in f.tensors.items():
        il = _direction_layer(name)
        if il < 0:
            raise AdapterError(f"{path}: invalid/unparsable direction tensor layer index in {name!r}")
        if il == 0:
            raise AdapterError(f"{path}: invalid (zero) direction tensor layer index in {name!r}")
        if tensor.dtype != F32:
            raise AdapterError(f"{path}: invalid (non-F32) direction tensor type: {name!r} is {tensor.dtype}")
        if sum(n != 1 for n in _ne(tensor.shape)[1:]):
            raise AdapterError(f"{path}: invalid (non-1D) direction tensor shape: {name!r} is {list(tensor.shape)}")
        size = int(np.prod(tensor.shape))
        if n_embd == -1:
            n_embd = size
        elif size != n_embd:
            raise AdapterError(f"{path}: direction tensor {name!r} does not match previous dimensions "
                               f"({size} != {n_embd})")
        if data.size < n_embd * il:
            data = np.concatenate([data, np.zeros(n_embd * il - data.size, np.float32)])
        data[n_embd * (il - 1):n_embd * il] += np.asarray(tensor.data, np.float32).reshape(-1) * strength
    return n_embd, data


_STOI = re.compile(r"\s*([+-]?\d+)")


def _direction_layer(name: str) -> int:
    """The layer of "direction.{il}" as llama.cpp reads it (std::stoi of what follows the first
    dot: leading digits count, trailing text is ignored); -1 when it is not such a name."""
    head, dot, rest = name.partition(".")
    if not dot or head != "direction":
        return -1
    m = _STOI.match(rest)
    if m is None or not -2**31 <= int(m[1]) < 2**31:
        return -1
    return int(m[1])


__all__ = ["AdaptedModel", "AdapterError", "AdapterSet", "ControlVector", "LoraAdapter", "LoraWeight",
           "cvec_leaf_name", "load_adapter_lora", "load_control_vectors"]
