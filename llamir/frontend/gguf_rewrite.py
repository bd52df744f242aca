"""Copy a GGUF file, keeping its metadata, optionally cut to fewer blocks and/or re-typed.

`rewrite(src, dst, n_layer=4)` keeps blocks 0..3 (and patches `<arch>.block_count`);
`rewrite(src, dst, dtype="f32")` dequantizes every 2-D matrix, which gives the tight oracle
file for a quantized model. Tensors are streamed a few MiB of rows at a time, so rewriting a
model never holds more than one chunk of it in memory.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from llamir.ir.dtypes import dtype_named

_CHUNK_BYTES = 16 << 20  # f32 bytes per converted chunk of rows
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.")

# general.file_type for a file whose matrices are all of one type (llama.cpp's llama_ftype).
FILE_TYPES: dict[str, gguf.LlamaFileType] = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
}


def rewrite(src: str | Path, dst: str | Path, *, dtype: str | None = None,
            n_layer: int | None = None) -> Path:
    """Write `src` to `dst` with blocks >= n_layer dropped and 2-D matrices stored as `dtype`."""
    src, dst = Path(src), Path(dst)
    target = GGMLQuantizationType[dtype.upper()] if dtype is not None else None
    if dtype is not None and dtype not in FILE_TYPES:
        raise ValueError(f"dtype={dtype!r} cannot be written by gguf.quants; use one of {tuple(FILE_TYPES)}")
    reader = GGUFReader(src, "r")
    if reader.endianess != gguf.GGUFEndian.LITTLE:
        raise ValueError(f"{src}: a big-endian GGUF file; llama.cpp and llamir read little-endian files only")
    arch = _string(reader, "general.architecture")
    block_key = f"{arch}.block_count"
    n_blocks = int(reader.fields[block_key].parts[-1][0])
    if n_layer is not None and not 1 <= n_layer <= n_blocks:
        raise ValueError(f"n_layer={n_layer} is outside 1..{n_blocks} (the blocks of {src.name})")

    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=dst.name + ".", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        writer = _Writer(tmp_name, arch)
        writer.data_alignment = reader.alignment
        _copy_metadata(reader, writer, overrides={
            block_key: n_layer if n_layer is not None else None,
            "general.file_type": int(FILE_TYPES[dtype]) if dtype is not None else None,
        })
        plan = [(t, _out_type(t, target)) for t in reader.tensors if _keep(t.name, n_layer)]
        for tensor, out_type in plan:
            shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
            block, type_size = gguf.GGML_QUANT_SIZES[out_type]
            nbytes = int(np.prod(shape)) // block * type_size
            writer.add_tensor_info(tensor.name, shape, np.dtype(np.float32), nbytes, raw_dtype=out_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        out = writer.fout[0]
        for tensor, out_type in plan:
            writer.write_padding(out, out.tell())
            written = 0
            for chunk in _converted_chunks(tensor, out_type):
                out.write(chunk.tobytes())
                written += chunk.nbytes
            writer.write_padding(out, written)
        writer.close()
        os.chmod(tmp_name, 0o644)  # mkstemp makes it private; a cached model is an ordinary file
        os.replace(tmp_name, dst)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return dst


class _EncodedValue(bytes):
    """A metadata value's bytes as encoded in the source file (what follows its type)."""


class _Writer(gguf.GGUFWriter):
    """GGUFWriter that writes an _EncodedValue verbatim after its type."""

    def _pack_val(self, val: Any, vtype: GGUFValueType, add_vtype: bool,
                  sub_type: GGUFValueType | None = None) -> bytes:
        if isinstance(val, _EncodedValue):
            return (self._pack("I", vtype) if add_vtype else b"") + val
        return super()._pack_val(val, vtype, add_vtype, sub_type)


def _keep(name: str, n_layer: int | None) -> bool:
    match = _BLOCK_NAME.match(name)
    return n_layer is None or match is None or int(match.group(1)) < n_layer


def _out_type(tensor: Any, target: GGMLQuantizationType | None) -> GGMLQuantizationType:
    """The type a tensor is written as: `target` for 2-D matrices, its own type otherwise."""
    if target is None or len(tensor.shape) != 2:
        return tensor.tensor_type
    row = int(tensor.shape[0])  # ne[0], the contiguous row length
    block = gguf.GGML_QUANT_SIZES[target][0]
    if row % block:
        raise ValueError(f"{tensor.name}: rows of {row} elements cannot be stored as {target.name} "
                         f"(blocks of {block})")
    return target


def _converted_chunks(tensor: Any, out_type: GGMLQuantizationType) -> Iterator[np.ndarray]:
    """The tensor's data as `out_type`, a group of rows at a time (a byte copy if the type is kept)."""
    in_type = tensor.tensor_type
    rows = tensor.data.reshape(-1, tensor.data.shape[-1]) if tensor.data.ndim > 1 else tensor.data[None]
    if in_type == out_type:
        step = max(1, _CHUNK_BYTES // max(1, rows[0].nbytes))
        for start in range(0, rows.shape[0], step):
            yield np.ascontiguousarray(rows[start:start + step])
        return
    n = int(tensor.shape[0])
    step = max(1, _CHUNK_BYTES // (4 * n))
    for start in range(0, rows.shape[0], step):
        values = _dequantize(np.ascontiguousarray(rows[start:start + step]), in_type).reshape(-1, n)
        yield _quantize(values, out_type)


def _dequantize(data: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    if ggml_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return data.astype(np.float32)  # the reader already gives typed arrays for these
    return gguf.quants.dequantize(data, ggml_type).astype(np.float32, copy=False)


def _quantize(values: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    data = gguf.quants.quantize(values, ggml_type)
    expected = dtype_named(ggml_type.name).row_bytes(values.shape[-1]) * values.shape[0]
    assert data.nbytes == expected, f"{ggml_type.name}: {data.nbytes} bytes, expected {expected}"
    return data


def _string(reader: GGUFReader, key: str) -> str:
    if key not in reader.fields:
        raise ValueError(f"{reader.data.filename}: required metadata key {key!r} is missing")
    return bytes(reader.fields[key].parts[-1]).decode("utf-8")


def _copy_metadata(reader: GGUFReader, writer: gguf.GGUFWriter, overrides: dict[str, int | None]) -> None:
    """Every key/value of `reader` into `writer`, with its original GGUF type; non-None overrides win."""
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the header counts and the architecture are written by GGUFWriter itself
        vtype = GGUFValueType(field.types[0])
        if overrides.get(key) is not None:
            writer.add_key_value(key, overrides[key], vtype)
            continue
        if vtype == GGUFValueType.ARRAY:
            sub_type = GGUFValueType(field.types[1])
            if sub_type == GGUFValueType.ARRAY:
                # GGUFReader flattens nested arrays, and GGUFWriter would re-type their items:
                # copy the encoded value as it stands in the source
                writer.add_key_value(key, _EncodedValue(b"".join(p.tobytes() for p in field.parts[3:])), vtype)
                continue
            if sub_type == GGUFValueType.STRING:
                items: list[Any] = [bytes(field.parts[i]) for i in field.data]
            else:
                items = [field.parts[i][0].item() for i in field.data]
            writer.add_key_value(key, items, vtype, sub_type=sub_type)
        elif vtype == GGUFValueType.STRING:
            writer.add_key_value(key, bytes(field.parts[-1]), vtype)
        else:
            writer.add_key_value(key, field.parts[-1][0].item(), vtype)
    for key, value in overrides.items():
        if value is not None and key not in reader.fields:
            writer.add_uint32(key, value)
