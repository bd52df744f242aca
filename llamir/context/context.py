"""Context: llama_context in Python. decode() runs batches through the model's graph over the
KV cache and keeps the outputs; the getters mirror llama.h."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from llamir.backends import Backend, BackendError, get_backend
from llamir.context.batch import LLAMA_MAX_SEQ, Batch, BatchAllocator, BatchError, UBatch
from llamir.context.graph_inputs import (
    GraphParams, GraphResult, InputAttnKV, InputEmbd, InputOutIds, InputPos,
)
from llamir.context.kv_cache import KVCache, KVCacheContext, MemoryStatus
from llamir.context.params import ContextParams, CParams, resolve
from llamir.frontend.graph_context import GraphConfig
from llamir.frontend.model import Model
from llamir.ir import IRError

log = logging.getLogger("llamir")

# llama_decode's return codes
DECODE_OK, DECODE_NO_SLOT, DECODE_ABORTED = 0, 1, 2
DECODE_INVALID, DECODE_ALLOC, DECODE_COMPUTE = -1, -2, -3


class AbortedError(RuntimeError):
    """Raised inside a compute when the abort callback asks to stop."""


class Context:
    """llama_context: memory, graphs and outputs for one model.

        ctx = Context(model, n_ctx=2048, n_batch=512, n_ubatch=512, backend="numpy")
        status = ctx.decode(Batch.from_tokens(tokens, logits="last"))
        row = ctx.get_logits_ith(-1)
    """

    def __init__(self, model: Model, params: ContextParams | None = None, *, backend: str | Backend = "numpy",
                 **kwargs):
        self.model = model
        self.params = params if params is not None else ContextParams(**kwargs)
        if params is not None and kwargs:
            raise TypeError("pass either a ContextParams or keyword parameters, not both")
        self.cparams: CParams = resolve(self.params, model.hparams)
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        if self.cparams.auto_fa:
            self.cparams = self.cparams.with_flash_attn(self._backend_runs_flash_attn())
        hp = model.hparams
        self.memory = KVCache(hp, self.cparams.n_ctx_seq, self.cparams.n_seq_max, unified=self.cparams.kv_unified,
                              type_k=self.cparams.type_k, type_v=self.cparams.type_v,
                              v_trans=not self.cparams.flash_attn)
        self.balloc = BatchAllocator()
        self.n_vocab = hp.n_vocab
        self.logits = np.zeros((0, self.n_vocab), dtype=np.float32)
        self.embd = np.zeros((0, hp.n_embd), dtype=np.float32)
        self.output_ids = np.full(self.cparams.n_batch, -1, dtype=np.int64)
        self.n_outputs = 0
        self.last_error = ""
        self.abort_callback: Callable[[], bool] | None = None
        self.cb_eval: Callable | None = None
        self.n_reused = 0
        self._prev: GraphResult | None = None
        self._compiled: dict[GraphConfig, tuple] = {}
        self._weights: dict[str, np.ndarray] = {}
        self.t_start = time.perf_counter()

    # -- graphs -----------------------------------------------------------------------------------
    def _backend_runs_flash_attn(self) -> bool:
        """flash_attn=auto: build the graph with flash attention and keep it only if the backend
        supports every __fattn__ node (llama.cpp checks where the scheduler put them)."""
        from llamir.frontend.graph_kv import KVLayout
        from llamir.ir import ops

        probe_kv = KVLayout(kv_size=256, type_k=self.cparams.type_k, type_v=self.cparams.type_v, v_trans=False)
        config = GraphConfig(kv=probe_kv, rope=self.cparams.rope, flash_attn=True,
                             causal_attn=self.cparams.causal_attn)
        graph = self.model.build_graph(config)
        return all(self.backend.supports_op(n) for n in graph.nodes if n.is_op(ops.FlashAttnExt))

    def graph_config(self, has_tokens: bool) -> GraphConfig:
        return GraphConfig(kv=self.memory.layout, rope=self.cparams.rope, flash_attn=self.cparams.flash_attn,
                           causal_attn=self.cparams.causal_attn, input_kind="tokens" if has_tokens else "embd",
                           embeddings=self.cparams.embeddings)

    def _compiled_graph(self, config: GraphConfig):
        """The symbolic graph for `config` and its executable, built once and kept."""
        if config not in self._compiled:
            graph = self.model.build_graph(config)
            unsupported = self.backend.unsupported(graph)
            if unsupported:
                names = ", ".join(sorted({n.op.name for n in unsupported}))
                raise BackendError(f"backend {self.backend.name} cannot run: {names}")
            self._compiled[config] = (graph, self.backend.compile(graph))
            for leaf in graph.leafs_of_kind("weight"):
                self._weights.setdefault(leaf.name, self.model.weight_array(leaf.name))
        return self._compiled[config]

    def _build_result(self, ubatch: UBatch, mctx: KVCacheContext, params: GraphParams) -> GraphResult:
        graph, executable = self._compiled_graph(self.graph_config(ubatch.tokens is not None))
        hp = self.model.hparams
        mask_dtype = np.float16 if self.cparams.flash_attn else np.float32
        inputs = [InputEmbd(ubatch.tokens is not None), InputPos(), InputOutIds(n_outputs=params.n_outputs),
                  InputAttnKV(mctx, hp.n_embd_v_gqa(), self.cparams.causal_attn, mask_dtype,
                              alibi=hp.f_max_alibi_bias > 0)]
        return GraphResult(graph, executable, params, inputs)

    # -- decode -----------------------------------------------------------------------------------
    def decode(self, batch: Batch) -> int:
        """llama_decode: 0 ok, 1 no KV slot, 2 aborted, -1 invalid batch, -2 memory, -3 compute."""
        self.last_error = ""
        hp = self.model.hparams
        if batch.n_tokens == 0:
            return self._fail(DECODE_INVALID, "n_tokens == 0")
        n_seq_max = LLAMA_MAX_SEQ if self.cparams.kv_unified else self.cparams.n_seq_max
        try:
            self.balloc.init(batch, hp.n_vocab, self.memory, hp.n_embd, n_seq_max, self.cparams.embeddings)
        except BatchError as err:
            return self._fail(DECODE_INVALID, f"invalid batch: {err}")
        n_tokens_all = self.balloc.n_tokens
        if n_tokens_all > self.cparams.n_batch:
            return self._fail(DECODE_INVALID, f"n_tokens = {n_tokens_all} > n_batch = {self.cparams.n_batch}")
        if not self.cparams.causal_attn and self.cparams.n_ubatch < n_tokens_all:
            return self._fail(DECODE_INVALID, "non-causal attention requires n_ubatch >= n_tokens")
        n_outputs_all = self.balloc.n_outputs
        mctx = self.memory.init_batch(self.balloc, self.cparams.n_ubatch, self.cparams.embeddings)
        if mctx.status == MemoryStatus.FAILED_PREPARE:
            log.warning("decode: failed to find a memory slot for batch of size %d", n_tokens_all)
            self.last_error = f"failed to find a memory slot for batch of size {n_tokens_all}"
            return DECODE_NO_SLOT
        if mctx.status != MemoryStatus.SUCCESS:
            return self._fail(DECODE_ALLOC, f"unexpected memory context status {mctx.status.name}")
        self._output_reserve(n_outputs_all)
        n_outputs_prev = 0
        while True:
            ubatch = mctx.get_ubatch()
            n_outputs = ubatch.n_tokens if n_outputs_all == n_tokens_all else ubatch.n_outputs
            status, message = self._process_ubatch(ubatch, mctx, n_outputs, n_outputs_prev)
            if status != DECODE_OK:
                self._rollback(ubatch)
                return self._fail(status, message)
            n_outputs_prev += n_outputs
            if not mctx.next():
                break
        self.n_outputs = n_outputs_all
        self._map_outputs()
        return DECODE_OK

    def _process_ubatch(self, ubatch: UBatch, mctx: KVCacheContext, n_outputs: int,
                        n_outputs_prev: int) -> tuple[int, str]:
        if self.abort_callback is not None and self.abort_callback():
            return DECODE_ABORTED, "aborted by the abort callback"
        mctx.apply()
        params = GraphParams.of(ubatch, n_outputs, self.cparams.embeddings, self.cparams.causal_attn)
        if self.cparams.graph_reuse and self._prev is not None and self._prev.can_reuse(params, mctx):
            self.n_reused += 1
            result = self._prev
        else:
            try:
                result = self._build_result(ubatch, mctx, params)
            except (IRError, BackendError) as err:
                return DECODE_COMPUTE, f"failed to build the graph: {err}"
            self._prev = result
        values = result.set_inputs(ubatch)
        values.update(self._weights)
        values.update(self.memory.buffers)
        bindings = {"T": ubatch.n_tokens, "n_kv": mctx.n_kv, "n_out": n_outputs}
        try:
            outputs = result.executable(values, bindings, self._observer())
        except AbortedError:
            return DECODE_ABORTED, "aborted during compute"
        except MemoryError as err:
            return DECODE_ALLOC, f"out of memory: {err}"
        except Exception as err:  # noqa: BLE001 - any backend failure is a compute failure (-3)
            return DECODE_COMPUTE, f"compute failed: {type(err).__name__}: {err}"
        if n_outputs and "logits" in outputs:
            self.logits[n_outputs_prev:n_outputs_prev + n_outputs] = outputs["logits"]
        if n_outputs and self.cparams.embeddings and "embd" in outputs:
            self.embd[n_outputs_prev:n_outputs_prev + n_outputs] = outputs["embd"]
        return DECODE_OK, ""

    def _observer(self):
        if self.cb_eval is None and self.abort_callback is None:
            return None

        def observe(node, value) -> bool:
            if self.abort_callback is not None and self.abort_callback():
                raise AbortedError()
            if self.cb_eval is not None:
                return self.cb_eval(node.name, value) is not False
            return True

        return observe

    def _rollback(self, ubatch: UBatch) -> None:
        """Remove this ubatch's positions from the memory; earlier ubatches stay (as llama.cpp)."""
        pos_min: dict[int, int] = {}
        for i, ids in enumerate(ubatch.seq_ids):
            s = ids[0]
            pos_min[s] = min(pos_min.get(s, int(ubatch.pos[i])), int(ubatch.pos[i]))
        for s, p in pos_min.items():
            self.memory.seq_rm(s, p, -1)

    def _fail(self, code: int, message: str) -> int:
        self.last_error = message
        log.error("decode: %s (returning %d)", message, code)
        return code

    # -- outputs ----------------------------------------------------------------------------------
    def _output_reserve(self, n_outputs: int) -> None:
        n_max = max(n_outputs, self.cparams.n_seq_max)
        if self.logits.shape[0] < n_max:
            self.logits = np.zeros((n_max, self.n_vocab), dtype=np.float32)
        if self.cparams.embeddings and self.embd.shape[0] < n_max:
            self.embd = np.zeros((n_max, self.model.hparams.n_embd), dtype=np.float32)
        self.output_ids[:] = -1
        self.n_outputs = 0

    def _map_outputs(self) -> None:
        """output_ids[batch index] = row; rows come in ubatch order, which is batch order for
        simple splits. Equal splits are put back in batch order here (llama.cpp's swaps)."""
        out_ids = np.asarray(self.balloc.out_ids, dtype=np.int64)
        order = np.argsort(out_ids, kind="stable")
        if np.any(order != np.arange(len(order))):
            self.logits[:len(order)] = self.logits[order]
            if self.cparams.embeddings:
                self.embd[:len(order)] = self.embd[order]
            out_ids = out_ids[order]
        self.output_ids[:] = -1
        self.output_ids[out_ids] = np.arange(len(out_ids))

    def get_logits(self) -> np.ndarray:
        """All output rows [n_outputs, n_vocab], in batch order."""
        return self.logits[:self.n_outputs]

    def get_logits_ith(self, i: int) -> np.ndarray:
        """The logits of batch token i (negative: from the last output backwards)."""
        return self.logits[self._output_row(i)]

    def get_embeddings(self) -> np.ndarray:
        if not self.cparams.embeddings:
            raise ValueError("embeddings are off for this context (create it with embeddings=True)")
        return self.embd[:self.n_outputs]

    def get_embeddings_ith(self, i: int) -> np.ndarray:
        if not self.cparams.embeddings:
            raise ValueError("embeddings are off for this context (create it with embeddings=True)")
        return self.embd[self._output_row(i)]

    def _output_row(self, i: int) -> int:
        if self.n_outputs == 0:
            raise IndexError("no outputs: decode a batch that asks for logits first")
        if i < 0:
            j = self.n_outputs + i
            if j < 0:
                raise IndexError(f"negative index {i} out of range [-{self.n_outputs}, 0)")
            return j
        if i >= len(self.output_ids):
            raise IndexError(f"out of range [0, {len(self.output_ids)})")
        j = int(self.output_ids[i])
        if j < 0:
            raise IndexError(f"batch.logits[{i}] != true: token {i} asked for no output")
        if j >= self.n_outputs:
            raise IndexError(f"corrupt output buffer (j={j}, n_outputs={self.n_outputs})")
        return j

    # -- conveniences -----------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self.cparams.n_ctx

    @property
    def n_batch(self) -> int:
        return self.cparams.n_batch

    @property
    def n_ubatch(self) -> int:
        return self.cparams.n_ubatch
