"""The context layer: batches, memory, graphs and outputs (llama_context)."""

from llamir.context.batch import Batch, BatchError, UBatch
from llamir.context.context import Context
from llamir.context.kv_cache import KVCache, MemoryStatus, SeqOpError
from llamir.context.outputs import OutputError
from llamir.context.params import ContextParams, ContextParamsError

__all__ = ["Batch", "BatchError", "Context", "ContextParams", "ContextParamsError", "KVCache", "MemoryStatus",
           "OutputError", "SeqOpError", "UBatch"]
