"""The tensor IR: dtypes, types, ops, graphs, text form, verifier and the numpy reference."""

from llamir.ir import geometry, ggml_math, ops, quants
from llamir.ir.bind import bind_dims
from llamir.ir.builder import GraphBuilder, layer_name
from llamir.ir.dims import Dim, Sym, sym
from llamir.ir.dtypes import (
    BF16,
    F16,
    F32,
    I8,
    I16,
    I32,
    I64,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    Q8_1,
    Q8_K,
    DType,
    dtype_from_ggml,
    dtype_named,
)
from llamir.ir.graph import Graph, Node
from llamir.ir.interp import Interpreter, run_graph
from llamir.ir.interp_nn import rope_corr_dims
from llamir.ir.ops import IRError
from llamir.ir.parser import ParseError, parse_graph
from llamir.ir.printer import fingerprint, print_graph
from llamir.ir.quants import vec_dot_type
from llamir.ir.types import TensorType, parse_type
from llamir.ir.verifier import VerifyError, verify

__all__ = [name for name in dir() if not name.startswith("_")]
