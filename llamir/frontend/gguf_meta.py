"""GGUF metadata with the type each value was stored as, and llama.cpp's typed getters over it.

llama.cpp reads every key through `llama_model_loader::get_key<T>` (the stored type must be exactly
T's: a u32 key stored as i32 or u64 is refused), `get_arr` (u32/i32 items for integer arrays, f32,
string, and bool as 0/1 in per-layer arrays) and `get_key_or_arr` (a scalar repeated per layer or an
array of exactly n_layer items). `Metadata` keeps those rules in one place, so a wrong type, an
array where a scalar belongs or a bad value is refused with a message naming the key and the value.

Metadata built from plain Python values (tests, tools) has no stored types: the getters then check
the value's Python kind and range instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np


class GGUFError(ValueError):
    """A GGUF file that cannot be used, with the reason in the message."""


class MetadataError(GGUFError):
    """A metadata value of the wrong type or out of range, named by its key."""


class GGUFType(IntEnum):
    """gguf_type (ggml/include/gguf.h)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12

    @property
    def label(self) -> str:
        """gguf_type_name: u8, i8, ..., str, arr."""
        return _LABELS[self]


_LABELS = dict(zip(GGUFType, ("u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "str", "arr", "u64", "i64",
                              "f64"), strict=True))
_INT_RANGES = {GGUFType.UINT8: (0, 2**8), GGUFType.INT8: (-2**7, 2**7), GGUFType.UINT16: (0, 2**16),
               GGUFType.INT16: (-2**15, 2**15), GGUFType.UINT32: (0, 2**32), GGUFType.INT32: (-2**31, 2**31),
               GGUFType.UINT64: (0, 2**64), GGUFType.INT64: (-2**63, 2**63)}
_LAYER_ITEMS = (GGUFType.UINT32, GGUFType.INT32, GGUFType.BOOL)   # get_arr into std::array<uint32_t, N>
LLAMA_MAX_LAYERS = 512


@dataclass(frozen=True, slots=True)
class ValueType:
    """The stored type of one value; `item` is the element type of an array."""

    type: GGUFType
    item: GGUFType | None = None

    def __str__(self) -> str:
        return f"arr[{self.item.label}]" if self.item is not None else self.type.label


def show(value: Any, limit: int = 60) -> str:
    """A short repr of a metadata value for error messages."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 5] + " ...]" if text[0] == "[" else text[:limit - 3] + "..."


class Metadata(Mapping[str, Any]):
    """key -> value (int, float, bool, str, numpy array or list of str), with each key's stored type."""

    def __init__(self, values: Mapping[str, Any], types: Mapping[str, ValueType] | None = None,
                 source: str = "GGUF metadata"):
        self._values = dict(values)
        self._types = dict(types or {})
        self.source = source

    @classmethod
    def of(cls, meta: Mapping[str, Any]) -> Metadata:
        """`meta` itself if it is Metadata, else its plain values without stored types."""
        return meta if isinstance(meta, Metadata) else cls(meta)

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __or__(self, other: Mapping[str, Any]) -> Metadata:
        """A copy with `other`'s values; keys it sets keep its stored types (none for a plain dict)."""
        types = {k: t for k, t in self._types.items() if k not in other}
        if isinstance(other, Metadata):
            types |= other._types
        return Metadata(self._values | dict(other), types, self.source)

    def type_of(self, key: str) -> ValueType | None:
        """The stored type of `key` (None when missing or given as a plain Python value)."""
        return self._types.get(key)

    def value_type(self, key: str) -> ValueType:
        """The stored type of `key`, or the one its plain Python value stands for."""
        return self._types.get(key) or python_type(self._values[key])

    # ---------------------------------------------------------------- llama.cpp's getters

    def get_u32(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        """get_key<uint32_t>: a u32 value."""
        return self._scalar(key, GGUFType.UINT32, default, required)

    def get_u16(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        """get_key<uint16_t>: a u16 value."""
        return self._scalar(key, GGUFType.UINT16, default, required)

    def get_f32(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        """get_key<float>: an f32 value (NaN and inf included: callers check what they need)."""
        return self._scalar(key, GGUFType.FLOAT32, default, required)

    def get_bool(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        """get_key<bool>: a bool value."""
        return self._scalar(key, GGUFType.BOOL, default, required)

    def get_str(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        """get_key<std::string>: a string value."""
        return self._scalar(key, GGUFType.STRING, default, required)

    def get_arr_n(self, key: str, default: Any = None) -> Any:
        """get_arr_n: the length of an array value (any other type is refused)."""
        if key not in self._values:
            return default
        self._require_array(key, None)
        return len(self._values[key])

    def get_arr(self, key: str, items: tuple[GGUFType, ...], default: Any = None, *,
                non_array_missing: bool = False) -> Any:
        """An array whose items are one of `items`. With non_array_missing a non-array value counts
        as absent, as get_arr<std::vector> does; otherwise it is refused."""
        if key not in self._values:
            return default
        if non_array_missing and not self._is_array(key):
            return default
        self._require_array(key, items)
        return self._values[key]

    def get_u32_or_arr(self, key: str, n: int, default: Any = None) -> tuple[int, ...] | Any:
        """get_key_or_arr<std::array<uint32_t, 512>>: a u32 repeated n times, or an array of exactly
        n u32/i32/bool items (i32 wraps to uint32 as llama.cpp's copy does; bool is 0 or 1)."""
        if key not in self._values:
            return default
        if n > LLAMA_MAX_LAYERS:
            raise MetadataError(f"{self.source}: n > N_MAX: {n} > {LLAMA_MAX_LAYERS} for key {key}")
        if not self._is_array(key):
            return (self.get_u32(key),) * n
        values = self.get_u32_arr(key)
        if len(values) != n:
            raise MetadataError(f"{self.source}: metadata key {key!r} has {len(values)} entries, expected {n} "
                                f"(one per layer): {show(self._values[key])}")
        return values

    def get_u32_arr(self, key: str, default: Any = None) -> tuple[int, ...] | Any:
        """get_arr<std::array<uint32_t, 512>>: u32, i32 (wrapped) or bool (0/1) items, at most 512;
        a value that is not an array counts as absent."""
        values = self.get_arr(key, _LAYER_ITEMS, default, non_array_missing=True)
        if values is default:
            return default
        if len(values) > LLAMA_MAX_LAYERS:
            raise MetadataError(f"{self.source}: array length {len(values)} for key {key} exceeds max "
                                f"{LLAMA_MAX_LAYERS}")
        if self.value_type(key).item == GGUFType.BOOL:
            return tuple(int(bool(v)) for v in values)
        if self.type_of(key) is None:   # plain Python values: the same range rules as stored ones
            for i, v in enumerate(values):
                self._check_python(f"{key}[{i}]", v, GGUFType.UINT32)
        return tuple(int(v) for v in np.asarray(values).astype(np.int64).astype(np.uint32))

    # ---------------------------------------------------------------- checks

    def _scalar(self, key: str, want: GGUFType, default: Any, required: bool) -> Any:
        if key not in self._values:
            if required:
                raise MetadataError(f"{self.source}: required metadata key {key!r} is missing")
            return default
        value, vtype = self._values[key], self.type_of(key)
        if vtype is None:
            return self._check_python(key, value, want)
        if vtype.type != want:
            raise MetadataError(f"{self.source}: metadata key {key!r} has type {vtype} but llama.cpp reads it "
                                f"as {want.label} (value {show(value)})")
        return value

    def _check_python(self, key: str, value: Any, want: GGUFType) -> Any:
        """The rules for a value given as a plain Python object rather than read from a file."""
        if want == GGUFType.STRING:
            ok = isinstance(value, str)
        elif want == GGUFType.BOOL:
            ok = isinstance(value, (bool, np.bool_))
        elif want in (GGUFType.FLOAT32, GGUFType.FLOAT64):
            ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
            value = float(value) if ok else value
        else:
            lo, hi = _INT_RANGES[want]
            ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) \
                and lo <= int(value) < hi
            value = int(value) if ok else value
        if not ok:
            raise MetadataError(f"{self.source}: metadata key {key!r} = {show(value)} is not a {want.label}")
        return value

    def _is_array(self, key: str) -> bool:
        vtype = self.type_of(key) or python_type(self._values[key])
        return vtype.type == GGUFType.ARRAY

    def _require_array(self, key: str, items: tuple[GGUFType, ...] | None) -> None:
        value, stored = self._values[key], self.type_of(key)
        vtype = stored or python_type(value)
        if vtype.type != GGUFType.ARRAY:
            raise MetadataError(f"{self.source}: metadata key {key!r} has type {vtype} but llama.cpp reads it "
                                f"as an array (value {show(value)})")
        if items is None or vtype.item in items:
            return
        if stored is None and (_same_kind(vtype.item, items) or vtype.item is None and _mixed_numbers(value, items)):
            return   # plain Python values: any integer width stands for any other
        wanted = "/".join(f"arr[{t.label}]" for t in items)
        raise MetadataError(f"{self.source}: metadata key {key!r} has type {vtype} but llama.cpp reads it as "
                            f"{wanted}")


def _same_kind(item: GGUFType | None, items: tuple[GGUFType, ...]) -> bool:
    return item in _INT_RANGES and any(t in _INT_RANGES for t in items)


def _mixed_numbers(value: Any, items: tuple[GGUFType, ...]) -> bool:
    """A plain list of no items, or of ints and floats mixed, for an array of floats."""
    kinds = {python_type(v).type if isinstance(v, _PYTHON_VALUES) else None for v in value}
    floats = any(t in (GGUFType.FLOAT32, GGUFType.FLOAT64) for t in items)
    return not kinds or (floats and kinds == {GGUFType.INT64, GGUFType.FLOAT32})


_PYTHON_VALUES = (bool, np.bool_, str, int, np.integer, float, np.floating, np.ndarray, list, tuple)


def python_type(value: Any) -> ValueType:
    """The GGUF type a plain Python value stands for (item None: an array of mixed or no items)."""
    if isinstance(value, (bool, np.bool_)):
        return ValueType(GGUFType.BOOL)
    if isinstance(value, str):
        return ValueType(GGUFType.STRING)
    if isinstance(value, (int, np.integer)):
        return ValueType(GGUFType.INT64)
    if isinstance(value, (float, np.floating)):
        return ValueType(GGUFType.FLOAT32)
    if isinstance(value, np.ndarray):
        return ValueType(GGUFType.ARRAY, _NUMPY_ITEMS.get(value.dtype.str.lstrip("<|=")))
    if isinstance(value, (list, tuple)):
        kinds = {python_type(v).type if isinstance(v, _PYTHON_VALUES) else None for v in value}
        return ValueType(GGUFType.ARRAY, next(iter(kinds)) if len(kinds) == 1 else None)
    return ValueType(GGUFType.ARRAY if hasattr(value, "__len__") else GGUFType.STRING)


_NUMPY_ITEMS = {"u1": GGUFType.UINT8, "i1": GGUFType.INT8, "u2": GGUFType.UINT16, "i2": GGUFType.INT16,
                "u4": GGUFType.UINT32, "i4": GGUFType.INT32, "f4": GGUFType.FLOAT32, "b1": GGUFType.BOOL,
                "u8": GGUFType.UINT64, "i8": GGUFType.INT64, "f8": GGUFType.FLOAT64}

