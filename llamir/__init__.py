"""llamir: a graph compiler for LLM inference.

    model = llamir.load_model("model.gguf")
    ctx = llamir.Context(model, n_ctx=2048, backend="numpy")
    ctx.decode(llamir.Batch.from_tokens(model.vocab.tokenize("Hello"), logits="last"))
    row = ctx.get_logits_ith(-1)
"""

from llamir.context import Batch, BatchError, Context, ContextParams, ContextParamsError, OutputError, SeqOpError
from llamir.context.state_io import StateError
from llamir.frontend.adapter import AdapterError, LoraAdapter, load_adapter_lora
from llamir.frontend.model import Model, ModelError, load_model
from llamir.frontend.placement import PlacementParams

__version__ = "0.1.0"
__all__ = ["AdapterError", "Batch", "BatchError", "Context", "ContextParams", "ContextParamsError", "LoraAdapter",
           "Model", "ModelError", "OutputError", "PlacementParams", "SeqOpError", "StateError", "load_adapter_lora",
           "load_model", "__version__"]
