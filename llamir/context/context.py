"""Context: llama_context in Python. decode() runs batches through the model's graph over the
memory (KV cache) and keeps the outputs; encode() runs the non-causal path; the getters, the
sequence operations on `ctx.memory`, state and perf mirror llama.h."""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import numpy as np

from llamir.backends import Backend, BackendError, DeviceType, get_backend
from llamir.backends.registry import backend_from_spec, get_registry
from llamir.context import state
from llamir.context.adapters import ContextAdapters
from llamir.context.backend_sampling import graph_specs
from llamir.context.batch import LLAMA_MAX_SEQ, Batch, BatchAllocator, BatchError, UBatch
from llamir.context.graph_inputs import CrossState, GraphParams, GraphResult, build_inputs
from llamir.context.kv_cache import MemoryStatus
from llamir.context.memory import Memory, create_memory
from llamir.context.memory_update import MemoryUpdater
from llamir.context.outputs import OutputError, Outputs
from llamir.context.params import ContextParams, ContextParamsError, CParams, resolve
from llamir.context.perf import Perf
from llamir.context.runner import Runner
from llamir.context.token_step import TokenStep
from llamir.frontend.graph_context import GraphConfig
from llamir.frontend.model import Model
from llamir.frontend.placement import PlacementError, PlacementParams
from llamir.ir import IRError
from llamir.ir.numerics import Numerics, numerics_named
from llamir.sched.scheduler import SchedError

log = logging.getLogger("llamir")

# llama_decode's return codes
DECODE_OK, DECODE_NO_SLOT, DECODE_ABORTED = 0, 1, 2
DECODE_INVALID, DECODE_ALLOC, DECODE_COMPUTE = -1, -2, -3


class AbortedError(RuntimeError):
    """Raised inside a compute when the abort callback asks to stop."""


def _device_first(backend: str | Backend, devices: Sequence[str | Backend], placement: PlacementParams | None):
    """backend= naming a device (e.g. "vulkan", "vulkan:1", or a device backend): the model runs
    there, every layer offloaded unless `placement` says otherwise, with the CPU (llvm) for what
    the device does not run, as llama.cpp runs on a GPU by default. A CPU backend stays as it is."""
    if isinstance(backend, str):
        if get_registry(backend.split(":")[0]).devices()[0].type == DeviceType.CPU:
            return backend, devices, placement
        backend = backend_from_spec(backend)
    if backend.is_cpu:
        return backend, devices, placement
    return "llvm", [backend, *devices], placement or PlacementParams(n_gpu_layers=99)


def _cpu_backend(backend: str | Backend, numerics: Numerics | str | None, n_threads: int) -> Backend:
    """The context's CPU backend: made by name with the profile and thread count asked for, or the
    instance given, which keeps its own thread count unless one was asked for."""
    if isinstance(backend, str):
        options = {} if numerics is None else {"numerics": numerics_named(numerics)}
        if n_threads > 0:
            options["n_threads"] = n_threads
        return get_backend(backend, **options)
    if numerics is not None and getattr(backend, "numerics", None) != numerics_named(numerics):
        raise ContextParamsError(f"numerics={numerics_named(numerics)} was asked for, but the backend "
                                 f"{backend.name} reproduces {getattr(backend, 'numerics', 'no profile')}")
    if n_threads > 0:
        backend.set_n_threads(n_threads)
    return backend


class Context:
    """llama_context: memory, graphs and outputs for one model.

        ctx = Context(model, n_ctx=2048, n_batch=512, n_ubatch=512)          # LLVM JIT, host numerics
        status = ctx.decode(Batch.from_tokens(tokens, logits="last"))
        row = ctx.get_logits_ith(-1)
    """

    def __init__(self, model: Model, params: ContextParams | None = None, *, backend: str | Backend = "llvm",
                 numerics: Numerics | str | None = None, devices: Sequence[str | Backend] = (),
                 placement: PlacementParams | None = None, samplers: Mapping[int, object] | None = None,
                 **kwargs):
        """`backend` runs on the CPU (a name or an instance), or names a device ("vulkan") that
        gets every layer, with the LLVM CPU backend for the rest; `numerics` is the ggml build whose
        arithmetic it reproduces (llamir.ir.numerics; default: the backend's, which is the host's);
        `devices` (specs like "sim:gpu0:mem=2GiB" or backends) come first in the scheduler's
        priority order, with the model placed on them by `placement` (n_gpu_layers, split_mode,
        main_gpu, tensor_split, overrides) as llama.cpp places it. `n_threads` (0: the backend's
        own count, the CPUs this process may use) is given to the backend. `samplers` attaches
        backend samplers, {seq_id: llamir.sampling.Chain} (llama_context_params.samplers), reserved
        with the worst-case graphs: see set_sampler."""
        if params is not None and kwargs:
            raise TypeError("pass either a ContextParams or keyword parameters, not both")
        self.model = model
        self.params = params if params is not None else ContextParams(**kwargs)
        self.cparams: CParams = resolve(self.params, model.hparams)
        backend, devices, placement = _device_first(backend, devices, placement)
        self.backend = _cpu_backend(backend, numerics, self.cparams.n_threads)
        self.cparams = replace(self.cparams, n_threads=getattr(self.backend, "n_threads", self.cparams.n_threads))
        device_backends = [backend_from_spec(d) if isinstance(d, str) else d for d in devices]
        self.runner = Runner(model, [*device_backends, self.backend], placement or PlacementParams(),
                             self.cparams.op_offload)
        self.adapters = ContextAdapters(model)   # the LoRA adapters and control vector applied
        if self.cparams.auto_fa:
            self.cparams = self.cparams.with_flash_attn(self._flash_attn_works())
            if not self.cparams.flash_attn and self.cparams.type_v.is_quantized:
                raise ContextParamsError("quantized V cache was requested, but this requires Flash Attention")
        hp = model.hparams
        self.memory = self._create_memory()
        self.balloc = BatchAllocator()
        self.outputs = Outputs(hp.n_vocab, hp.n_embd, self.cparams.n_batch, self.cparams.n_seq_max,
                               has_embd=self.cparams.embeddings)
        self.last_error = ""
        self.abort_callback: Callable[[], bool] | None = None
        self.cb_eval: Callable[[str, np.ndarray | None, bool], bool] | None = None
        self.perf_counters = Perf(enabled=not self.cparams.no_perf, t_load_ms=getattr(model, "t_load_ms", 0.0))
        self._prev: GraphResult | None = None
        # an encoder-decoder's encoder output, kept by encode() for the decoder (llama_context::cross)
        self.cross: CrossState | None = None
        self._token_step: TokenStep | None = None
        self._last_bindings: dict[str, int] = {}
        # a generated token skips the general path's bookkeeping (llamir.context.token_step); the
        # results are the same either way: off, every batch takes the general path
        self.fast_token_decode = True
        self._updater = MemoryUpdater(model, self.backend, self.cparams.rope)
        self.samplers: dict[int, object] = {}          # llama_context's sampling.samplers
        self.backend_samplers: dict[int, list] = {}    # seq_id -> the chain's in-graph prefix
        for seq_id, chain in (samplers or {}).items():
            if not hasattr(chain, "samplers"):
                raise ContextParamsError("the backend samplers must be of type llamir.sampling.Chain "
                                         f"(seq_id {seq_id}: {type(chain).__name__})")
            self.set_sampler(seq_id, chain)
        if not self.runner.single:
            self.reserve()

    # -- construction -----------------------------------------------------------------------------
    def _create_memory(self) -> Memory | None:
        """The memory the architecture chooses (llama_model::create_memory), made for this context."""
        kind = self.model.arch.create_memory(self.model.hparams)
        return create_memory(kind, self.model.hparams, self.cparams, self.model.arch)

    def _flash_attn_works(self) -> bool:
        """flash_attn=auto: on the CPU alone, whether the backend runs the __fattn__ nodes; with
        devices, whether each layer's attention is scheduled on that layer's device (llama.cpp
        checks where the scheduler put them, for a 1-token batch over the full cache)."""
        from llamir.frontend.graph_kv import KVLayout
        from llamir.ir import ops

        cp, hp, arch = self.cparams, self.model.hparams, self.model.arch
        kind = arch.create_memory(hp)
        recurrent = arch.recurrent_layout(hp, max(1, cp.n_seq_max)) if kind in ("recurrent", "hybrid") else None
        attn_layers = tuple(il for il in range(hp.n_layer) if recurrent is None or il not in recurrent.layers)
        probe = KVLayout(kv_size=cp.n_ctx_seq, type_k=cp.type_k, type_v=cp.type_v, v_trans=False,
                         n_stream=1 if cp.kv_unified else cp.n_seq_max, layers=attn_layers)
        config = GraphConfig(memory=(probe,) if attn_layers else (), recurrent=recurrent, rope=cp.rope,
                             flash_attn=True, causal_attn=cp.causal_attn)
        if self.runner.single:
            graph = self.model.build_graph(config).graph
            return all(self.backend.supports_op(n) for n in graph.nodes if n.is_op(ops.FlashAttnExt))
        cg = self.runner.compiled(config)
        ok = self.runner.flash_attn_placed_well(cg, self._worst_bindings(cg, 1, 1))
        del self.runner.graphs[config]
        return ok

    def graph_config(self, has_tokens: bool, encoder: bool = False) -> GraphConfig:
        cp = self.cparams
        memory = () if encoder or self.memory is None else self.memory.layouts
        recurrent = None if encoder else getattr(self.memory, "rs_layout", None)
        samplers = () if encoder else tuple((seq, graph_specs(prefix)) for seq, prefix
                                            in sorted(getattr(self, "backend_samplers", {}).items())
                                            if graph_specs(prefix))
        return GraphConfig(memory=memory, recurrent=recurrent, rope=cp.rope, flash_attn=cp.flash_attn,
                           causal_attn=cp.causal_attn and not encoder, input_kind="tokens" if has_tokens else "embd",
                           embeddings=cp.embeddings, pooling=cp.pooling_type if cp.embeddings else "none",
                           gtype="encoder" if encoder else "decoder", adapters=self.adapters.graph_set(),
                           samplers=samplers)

    def compiled_graph(self, config: GraphConfig):
        """The symbolic graph for `config`, placed and (CPU only) compiled, built once and kept."""
        return self.runner.compiled(config)

    def _worst_bindings(self, cg, n_tokens: int, n_seqs: int) -> dict[str, int]:
        """Bindings of the reserve graphs: n_tokens over n_seqs sequences, the whole cache."""
        names = cg.graph.dim_names
        b = {"n_out": n_tokens, "T": n_tokens, "n_seqs": n_seqs}
        memory = getattr(self, "memory", None)   # the flash_attn probe runs before the memory exists
        for layout in memory.layouts if memory is not None else ():
            b[layout.n_kv_dim] = layout.kv_size
        b.setdefault("n_kv", self.cparams.n_ctx_seq)
        if "n_rs" in names:      # recurrent: n_seqs equal runs over every cell
            b["n_rs"] = memory.rs_layout.size if memory is not None else max(1, self.cparams.n_seq_max)
        if "rs_seqs" in names:
            b.update(rs_seqs=n_seqs, rs_seq_tokens=max(1, n_tokens // n_seqs))
            b["n_out"] = n_seqs * b["rs_seq_tokens"]
        b["n_enc"] = self.model.hparams.n_ctx_train   # the cross input before any encode, as llama.cpp sizes it
        if "ns" in names:
            ns = min(n_seqs, self.cparams.n_seq_max)
            b.update(ns=ns, T_s=max(1, n_tokens // ns), s0=0)
            b["T"] = b["n_out"] = ns * b["T_s"]
        return {k: v for k, v in b.items() if k in names}

    def reserve(self) -> dict[str, int]:
        """llama.cpp's worst-case reservation at construction: pp (n_ubatch tokens), tg (one token
        per sequence), then pp again; records the split counts and sizes the compute buffers."""
        cp = self.cparams
        cg = self.runner.compiled(self.graph_config(True))
        n_tokens, n_seqs = min(cp.n_ctx, cp.n_ubatch), cp.n_seq_max
        n_tokens = -(-n_tokens // n_seqs) * n_seqs
        worst = [("pp", self._worst_bindings(cg, n_tokens, n_seqs), n_tokens),
                 ("tg", self._worst_bindings(cg, n_seqs, n_seqs), n_seqs),
                 ("pp", self._worst_bindings(cg, n_tokens, n_seqs), n_tokens)]
        sizes = self.runner.reserve(cg, worst)
        if self.memory is not None:  # K/V placed on a device are allocated in its memory
            self.memory.place(cg.placement.buffers())
        for name, size in sizes.items():
            log.info("%10s compute buffer size = %8.2f MiB", name, size / 2**20)
        log.info("graph splits = %d (with bs=%d), %d (with bs=1)", self.runner.n_splits.get("pp", 0), n_tokens,
                 self.runner.n_splits.get("tg", 0))
        return sizes

    @property
    def n_splits(self) -> dict[str, int]:
        """Split counts of the reserved pp/tg graphs and of the last computed graph."""
        return dict(self.runner.n_splits)

    # -- decode -----------------------------------------------------------------------------------
    def decode(self, batch: Batch) -> int:
        """llama_decode: 0 ok, 1 no KV slot, 2 aborted, -1 invalid batch, -2 memory, -3 compute.

        The batch is checked (again: its fields may have changed since it was made) before any
        cell is taken. A failure (-2, -3) puts the memory and the outputs back as they were before
        the call; an abort (2) keeps the ubatches already computed, as llama.cpp does. Pending
        K-shifts and stream copies are applied first, as in llama.cpp, and stay applied (they
        change no logits). Nothing but a status comes back: the reason is in `last_error`."""
        if self.memory is None:   # a model without memory (bert) cannot decode: llama.cpp encodes
            return self.encode(batch)
        self.last_error = ""
        try:
            return self._decode(batch)
        except Exception as err:  # noqa: BLE001 - a bug; _decode has rolled back whatever it took
            log.exception("decode: internal error")
            return self._fail(DECODE_COMPUTE, f"internal error: {type(err).__name__}: {err}")

    def _decode(self, batch: Batch) -> int:
        if self.model.arch.has_encoder and self.cross is None:
            # llama.cpp asserts ("llama_encode must be called first") and aborts
            return self._fail(DECODE_INVALID, f"{self.model.hparams.arch}: the decoder attends to the encoder "
                                              "output: call encode() before decode()")
        if self._token_step is not None and self.fast_token_decode:
            status = self._token_step.decode(batch)
            if status is not None:
                return status
        hp, cp = self.model.hparams, self.cparams
        n_seq_max = LLAMA_MAX_SEQ if cp.kv_unified else cp.n_seq_max
        try:
            self.balloc.init(batch, hp.n_vocab, self.memory, hp.n_embd, n_seq_max, cp.embeddings)
        except BatchError as err:
            return self._fail(DECODE_INVALID, f"invalid batch: {err}")
        n_tokens_all = self.balloc.n_tokens
        problem = self._sampling_problem()
        if problem:
            return self._fail(DECODE_INVALID, problem)
        if n_tokens_all > cp.n_batch:
            return self._fail(DECODE_INVALID, f"n_tokens = {n_tokens_all} > n_batch = {cp.n_batch}")
        if not cp.causal_attn and cp.n_ubatch < n_tokens_all:
            return self._fail(DECODE_INVALID, "non-causal attention requires n_ubatch >= n_tokens")
        self.perf_counters.start(n_tokens_all)
        try:
            self.memory_update()
        except Exception as err:  # noqa: BLE001 - a K-shift that cannot compile or run changed nothing
            return self._fail(DECODE_ALLOC, f"memory update failed: {type(err).__name__}: {err}")
        n_outputs_all = self.balloc.n_outputs
        mctx = self.memory.init_batch(self.balloc, cp.n_ubatch, cp.embeddings)
        if mctx.status == MemoryStatus.FAILED_PREPARE and self.memory_update():
            mctx = self.memory.init_batch(self.balloc, cp.n_ubatch, cp.embeddings)
        if mctx.status == MemoryStatus.FAILED_PREPARE:
            log.warning("decode: failed to find a memory slot for batch of size %d", n_tokens_all)
            self.last_error = f"failed to find a memory slot for batch of size {n_tokens_all}"
            return DECODE_NO_SLOT
        if mctx.status != MemoryStatus.SUCCESS:
            return self._fail(DECODE_ALLOC, f"unexpected memory context status {mctx.status.name}")
        self.outputs.begin(n_outputs_all, sampling=self._batch_has_sampling())
        try:
            status, message = self._run_ubatches(mctx, n_tokens_all, n_outputs_all)
        except BaseException:
            mctx.rollback()
            self.outputs.abandon()
            raise
        if status != DECODE_OK:
            # an abort keeps the ubatches before the one it stopped (llama.cpp's documented rule)
            mctx.rollback(mctx.i_cur if status == DECODE_ABORTED else 0)
            self.outputs.abandon()
            return self._fail(status, message)
        self.outputs.commit(self.balloc.out_ids, n_outputs_all)
        self.perf_counters.stop()
        self._token_step = TokenStep.arm(self, self._prev, self._last_bindings) if n_tokens_all == 1 else None
        return DECODE_OK

    def _run_ubatches(self, mctx, n_tokens_all: int, n_outputs_all: int) -> tuple[int, str]:
        """Each ubatch in turn; the first failure stops (the caller rolls back)."""
        n_outputs_prev = 0
        while True:
            ubatch = mctx.get_ubatch()
            n_outputs = ubatch.n_tokens if n_outputs_all == n_tokens_all else ubatch.n_outputs
            status, message = self._process_ubatch(ubatch, mctx, n_outputs, n_outputs_prev)
            if status != DECODE_OK:
                return status, message
            n_outputs_prev += n_outputs
            if not mctx.next():
                return DECODE_OK, ""

    def _process_ubatch(self, ubatch: UBatch, mctx, n_outputs: int, n_outputs_prev: int,
                        encoder: bool = False) -> tuple[int, str]:
        if self.abort_callback is not None and self.abort_callback():
            return DECODE_ABORTED, "aborted by the abort callback"
        if mctx is not None:
            mctx.apply()
        gtype = "encoder" if encoder else "decoder"
        params = GraphParams.of(ubatch, n_outputs, self.cparams.embeddings, self.cparams.causal_attn and not encoder,
                                gtype)
        try:
            if self.cparams.graph_reuse and self._prev is not None and self._prev.can_reuse(params, mctx):
                self.perf_counters.n_reused += 1
                result = self._prev
            else:
                self._prev = None      # a graph that failed to build is never reused
                cg = self.compiled_graph(self.graph_config(ubatch.tokens is not None, encoder))
                result = GraphResult(cg, None, params, build_inputs(self, cg.built.inputs, ubatch, mctx, params,
                                                                   encoder))
                self._prev = result
            cg = result.graph
            if not result.values:  # weights and the memory's buffers are the same tensors every call
                result.values.update(cg.weights)
                if mctx is not None:
                    result.values.update(self.memory.buffers)
            values = result.set_inputs(ubatch, result.values)
            bindings = self._last_bindings = self._bindings(cg.graph, ubatch, mctx, n_outputs)
        except (IRError, BackendError, PlacementError, SchedError, ValueError) as err:
            return DECODE_COMPUTE, f"failed to build the graph: {type(err).__name__}: {err}"
        status, message, out = self._compute(cg, values, bindings, ubatch.n_tokens)
        if status == DECODE_OK:
            self._extract(ubatch, out, n_outputs, n_outputs_prev)
            if encoder and self.model.arch.has_encoder:   # the decoder's cross input until the next encode
                self.cross = CrossState.of(out["embd"], ubatch.seq_ids)
        return status, message

    def _compute(self, cg, values: dict, bindings: dict[str, int], n_tokens: int,
                 run: Callable[[], dict] | None = None) -> tuple[int, str, dict]:
        """Run one ubatch's graph (by `run` when given): (status, reason, outputs); any failure is
        a status, not an error."""
        try:
            out = run() if run is not None else self.runner.run(cg, values, bindings, n_tokens, self._observer())
            return DECODE_OK, "", out
        except AbortedError:
            return DECODE_ABORTED, "aborted during compute", {}
        except MemoryError as err:
            return DECODE_ALLOC, f"out of memory: {err}", {}
        except Exception as err:  # noqa: BLE001 - any backend failure is a compute failure (-3)
            return DECODE_COMPUTE, f"compute failed: {type(err).__name__}: {err}", {}

    def _bindings(self, graph, ubatch: UBatch, mctx, n_outputs: int) -> dict[str, int]:
        bindings = {"n_out": n_outputs}
        if mctx is not None:
            bindings.update(mctx.bindings(ubatch.n_tokens))
        elif "n_kv" in graph.dim_names:   # no memory (encode): what attention sees is the ubatch
            bindings["n_kv"] = ubatch.n_tokens
        if "T" in graph.dim_names:
            bindings["T"] = ubatch.n_tokens
        if "n_seqs" in graph.dim_names:
            bindings["n_seqs"] = ubatch.n_seqs_unq
        if "n_enc" in graph.dim_names:
            bindings["n_enc"] = self.cross.n_enc
        # a hybrid memory decides both its KV cache's dims and its recurrent part's; the graph reads some
        return {k: v for k, v in bindings.items() if k in graph.dim_names}

    def _extract(self, ubatch: UBatch, out: dict, n_outputs: int, row0: int) -> None:
        """Copy this ubatch's outputs: logits rows, embeddings rows, or pooled per-sequence vectors."""
        if not n_outputs:
            return
        pooled = out.get("embd_pooled")
        self.outputs.write(row0, out.get("logits"), out.get("embd") if pooled is None else None)
        if self.outputs.sampled is not None and self.backend_samplers:
            self._extract_sampled(ubatch, out, row0)
        if pooled is not None:
            for s, seq_id in enumerate(ubatch.seq_id_unq):
                self.outputs.embd_seq[seq_id] = np.array(pooled[s], dtype=np.float32)

    def _extract_sampled(self, ubatch: UBatch, out: dict, row0: int) -> None:
        """Each backend-sampled sequence's results into its output row (copy_tensor_async_*)."""
        rows: dict[int, int] = {}
        for r, i in enumerate(np.flatnonzero(ubatch.output)):
            rows.setdefault(ubatch.seq_ids[i][0], row0 + r)
        for seq in self.backend_samplers:
            if seq in rows:
                self.outputs.sampled.write(rows[seq], out.get(f"smpl{seq}_token"), out.get(f"smpl{seq}_logits"),
                                           out.get(f"smpl{seq}_probs"), out.get(f"smpl{seq}_candidates"))

    # -- backend samplers -------------------------------------------------------------------------
    def set_sampler(self, seq_id: int, chain) -> bool:
        """llama_set_sampler: attach `chain` (None: detach) to seq_id. The longest prefix of its
        samplers that can run in a graph (greedy, dist, top_k, top_p, min_p, temp, logit_bias)
        runs in the decode graph for the sequence's output row; the rest runs on the CPU when
        `chain.sample(ctx, i)` continues from what the graph left. True when the chain is
        attached. While any sampler is attached, a batch may have one output per sequence."""
        from llamir.context.backend_sampling import backend_prefix

        seq_id = operator.index(seq_id)
        if not 0 <= seq_id < LLAMA_MAX_SEQ:
            raise ContextParamsError(f"set_sampler: seq_id {seq_id} is out of range [0, {LLAMA_MAX_SEQ})")
        self._prev = None   # the next batch builds (or finds) the graph of the new set
        if chain is None or not getattr(chain, "samplers", None):
            if chain is not None:
                log.warning("set_sampler: an empty chain for seq_id %d cannot be offloaded", seq_id)
            self.samplers.pop(seq_id, None)
            self.backend_samplers.pop(seq_id, None)
            return False
        self.samplers[seq_id] = chain
        prefix = backend_prefix(chain, self.model.hparams.n_vocab)
        if prefix:
            self.backend_samplers[seq_id] = prefix
        else:
            self.backend_samplers.pop(seq_id, None)
        chain.backend_attach(len(prefix))
        return True

    def _sampling_problem(self) -> str:
        """The seed's rule: with backend samplers, at most one output per sequence in a batch."""
        if not self.samplers:
            return ""
        counts: dict[int, int] = {}
        for i in np.flatnonzero(self.balloc.output):
            for seq in self.balloc.seq_ids[i]:
                counts[seq] = counts.get(seq, 0) + 1
                if counts[seq] > 1:
                    return (f"backend sampling requires at most one output token per sequence (seq_id {seq} had "
                            f"{counts[seq]})")
        return ""

    def _batch_has_sampling(self) -> bool:
        """Whether an output of the batch belongs to a sequence with a backend sampler."""
        return bool(self.backend_samplers) and any(
            seq in self.backend_samplers for i in np.flatnonzero(self.balloc.output) for seq in self.balloc.seq_ids[i])

    def _sampled_row(self, i: int) -> int | None:
        return self.outputs.sampled_row(i)

    def get_sampled_token_ith(self, i: int) -> int:
        """The token the backend sampler of batch token i's sequence drew (LLAMA_TOKEN_NULL: none)."""
        row = self._sampled_row(i)
        return -1 if row is None else int(self.outputs.sampled.token[row])

    def _sampled(self, i: int, what: str) -> np.ndarray | None:
        row = self._sampled_row(i)
        if row is None:
            return None
        count = int(getattr(self.outputs.sampled, what + "_count")[row])
        return getattr(self.outputs.sampled, what)[row, :count] if count else None

    def get_sampled_probs_ith(self, i: int) -> np.ndarray | None:
        """The probabilities the in-graph prefix left for batch token i (None: it made none)."""
        return self._sampled(i, "probs")

    def get_sampled_logits_ith(self, i: int) -> np.ndarray | None:
        return self._sampled(i, "logits")

    def get_sampled_candidates_ith(self, i: int) -> np.ndarray:
        """The vocabulary ids of the sampled logits/probs entries (every id when none were narrowed)."""
        cands = self._sampled(i, "candidates")
        return cands if cands is not None else np.arange(self.model.hparams.n_vocab, dtype=np.int32)

    def get_sampled_probs_count_ith(self, i: int) -> int:
        row = self._sampled_row(i)
        return 0 if row is None else int(self.outputs.sampled.probs_count[row])

    def get_sampled_logits_count_ith(self, i: int) -> int:
        row = self._sampled_row(i)
        return 0 if row is None else int(self.outputs.sampled.logits_count[row])

    def get_sampled_candidates_count_ith(self, i: int) -> int:
        row = self._sampled_row(i)
        return 0 if row is None else int(self.outputs.sampled.candidates_count[row])

    def _observer(self):
        if self.cb_eval is None and self.abort_callback is None:
            return None

        def observe(node, value) -> bool:
            if self.abort_callback is not None and self.abort_callback():
                raise AbortedError()
            if self.cb_eval is not None and self.cb_eval(node.name, None, True):
                return self.cb_eval(node.name, value, False) is not False
            return True

        return observe

    def _fail(self, code: int, message: str) -> int:
        self.last_error = message
        log.error("decode: %s (returning %d)", message, code)
        return code

    # -- encode -----------------------------------------------------------------------------------
    def encode(self, batch: Batch) -> int:
        """llama_encode: one non-causal ubatch, every token an output, no memory; the embeddings
        (pooled per sequence unless pooling is none) come back through get_embeddings*. On any
        failure the previous outputs stay."""
        self.last_error = ""
        try:
            return self._encode(batch)
        except Exception as err:  # noqa: BLE001 - a bug; the outputs were put back
            log.exception("encode: internal error")
            return self._fail(DECODE_COMPUTE, f"internal error: {type(err).__name__}: {err}")

    def _encode(self, batch: Batch) -> int:
        hp = self.model.hparams
        try:   # positions are checked against the memory (a t5's decoder cells), as llama.cpp's are
            self.balloc.init(batch, hp.n_vocab, self.memory, hp.n_embd, self.cparams.n_seq_max, True)
        except BatchError as err:
            return self._fail(DECODE_INVALID, f"invalid batch: {err}")
        if self.cparams.n_ubatch < self.balloc.n_tokens:
            return self._fail(DECODE_INVALID, f"encode needs n_ubatch >= n_tokens ({self.balloc.n_tokens})")
        self.perf_counters.start(self.balloc.n_tokens)
        ubatch = self.balloc.split_simple(self.balloc.n_tokens)
        self.outputs.begin(ubatch.n_tokens)
        try:
            status, message = self._process_ubatch(ubatch, None, ubatch.n_tokens, 0, encoder=True)
        except BaseException:
            self.outputs.abandon()
            raise
        if status != DECODE_OK:
            self.outputs.abandon()
            return self._fail(status, message)
        self.outputs.commit(self.balloc.out_ids, ubatch.n_tokens)
        self.perf_counters.stop()
        return DECODE_OK

    # -- adapters ---------------------------------------------------------------------------------
    def set_adapters_lora(self, adapters: Sequence, scales: Sequence[float]) -> int:
        """llama_set_adapters_lora: apply these LoRA adapters (llamir.load_adapter_lora) with these
        scales from the next decode on, in place of the ones applied; [] and [] remove them all. The
        same set again changes nothing (the graph is reused); another set builds another graph.
        Returns 0, as llama.cpp does; AdapterError (nothing changed) for a bad list."""
        if self.adapters.set_loras(adapters, scales):
            self._adapters_changed()
        return 0

    def set_adapter_cvec(self, data, n_embd: int = 0, il_start: int = 0, il_end: int = 0) -> int:
        """llama_set_adapter_cvec: add a control vector to the output of blocks il_start..il_end
        (inclusive); data holds n_embd floats per layer starting at layer 1 (a layer the data does
        not reach keeps its previous vector, zeros at first). None turns it off. Returns 0;
        AdapterError (nothing changed) when n_embd is not the model's."""
        self.adapters.set_cvec(data, n_embd, il_start, il_end)
        self._adapters_changed()
        return 0

    apply_adapter_cvec = set_adapter_cvec   # llama.h's name for it before it was renamed

    def _adapters_changed(self) -> None:
        """llama.cpp's sched_need_reserve after an adapter change: the previous graph is not reused,
        the graphs read the new adapters, and with devices the compute buffers are reserved again."""
        self._prev = None
        self._token_step = None
        self.runner.use_adapters(self.adapters.graph_set(), self.adapters.tensors())
        if not self.runner.single:
            self.reserve()

    # -- memory -----------------------------------------------------------------------------------
    def memory_update(self) -> bool:
        """Apply pending K-shifts and stream copies (llama_memory_update); True if any ran."""
        return self.memory.init_update(self).apply()

    # -- outputs ----------------------------------------------------------------------------------
    @property
    def n_outputs(self) -> int:
        return self.outputs.n_outputs

    def get_logits(self) -> np.ndarray:
        """All output rows [n_outputs, n_vocab], in batch order."""
        self.outputs.reorder()
        return self.outputs.logits[:self.outputs.n_outputs]

    def get_logits_ith(self, i: int) -> np.ndarray:
        """The logits of batch token i (negative: from the last output backwards)."""
        return self.outputs.logits[self.outputs.row(i)]

    def get_embeddings(self) -> np.ndarray:
        self._require_embeddings()
        self.outputs.reorder()
        return self.outputs.embd[:self.outputs.n_outputs]

    def get_embeddings_ith(self, i: int) -> np.ndarray:
        self._require_embeddings()
        return self.outputs.embd[self.outputs.row(i)]

    def get_embeddings_seq(self, seq_id: int) -> np.ndarray:
        """The pooled embedding of a sequence (pooling mean/cls/last/rank)."""
        self._require_embeddings()
        if self.cparams.pooling_type == "none":
            raise OutputError("pooling is none: use get_embeddings_ith for per-token embeddings")
        try:
            return self.outputs.embd_seq[operator.index(seq_id)]
        except (KeyError, TypeError):
            raise OutputError(f"no pooled embedding for sequence {seq_id!r} in the last batch") from None

    def _require_embeddings(self) -> None:
        if not self.cparams.embeddings:
            raise OutputError("embeddings are off for this context (create it with embeddings=True)")

    # -- state ------------------------------------------------------------------------------------
    def state_get_size(self) -> int:
        return len(self.state_get_data())

    def state_get_data(self) -> bytes:
        """llama_state_get_data: the model arch and the memory, in llama.cpp's layout."""
        return state.write_state(self)

    def state_set_data(self, data: bytes) -> int:
        """llama_state_set_data: restore (the outputs are dropped); a bad blob raises StateError and
        changes nothing."""
        return state.read_state(self, data)

    def state_seq_get_size(self, seq_id: int, flags: int = 0) -> int:
        return len(self.state_seq_get_data(seq_id, flags))

    def state_seq_get_data(self, seq_id: int, flags: int = 0) -> bytes:
        return state.write_seq_state(self, seq_id, flags)

    def state_seq_set_data(self, data: bytes, dest_seq_id: int, flags: int = 0) -> int:
        """llama_state_seq_set_data into dest_seq_id, in [0, n_seq_max); a bad blob or id raises
        StateError and changes nothing."""
        return state.read_seq_state(self, data, dest_seq_id, flags)

    def state_save_file(self, path, tokens) -> int:
        """Session file: magic 'ggsn', version 10, the token list, then the state."""
        return state.save_file(self, path, tokens)

    def state_load_file(self, path, n_token_capacity: int) -> list[int]:
        """A session file of version 10 (llama.cpp's) or 9 (llamir's older ones); its tokens."""
        return state.load_file(self, path, n_token_capacity)

    def state_seq_save_file(self, path, seq_id: int, tokens) -> int:
        return state.save_seq_file(self, path, seq_id, tokens)

    def state_seq_load_file(self, path, dest_seq_id: int, n_token_capacity: int) -> list[int]:
        return state.load_seq_file(self, path, dest_seq_id, n_token_capacity)

    # -- memory breakdown -------------------------------------------------------------------------
    def memory_breakdown(self) -> dict[str, dict[str, int]]:
        """llama_context::memory_breakdown: bytes of model weights, context (KV cache) and compute
        buffers per device (the compute buffers come from the worst-case reservation)."""
        if not self.runner.reserved:
            self.reserve()
        cg = self.runner.compiled(self.graph_config(True))
        placement, sched = cg.placement, self.runner.sched
        memory_buffers = self.memory.buffers if self.memory is not None else {}
        out: dict[str, dict[str, int]] = {}
        for b in placement.backends:
            out[b.label] = {"model": placement.weight_bytes.get(b.label, 0),
                            "context": sum(buf.nbytes for name, buf in memory_buffers.items()
                                           if placement.state.get(name) == b.label),
                            "compute": sched.buffer_sizes().get(b.label, 0)}
        return out

    def memory_breakdown_print(self, file=None) -> None:
        """llama_memory_breakdown_print's table (MiB): devices with total/free, then the host."""
        import sys

        rows = [["memory breakdown [MiB]", "total", "free", "self", "model", "context", "compute", "unaccounted"]]
        mib = 2**20
        for b in self.runner.backends:
            mb = self.memory_breakdown()[b.label]
            self_bytes = mb["model"] + mb["context"] + mb["compute"]
            if b.is_cpu:
                rows.append([f"  - Host ({b.name})", "", "", str(self_bytes // mib), str(mb["model"] // mib),
                             str(mb["context"] // mib), str(mb["compute"] // mib), ""])
            else:
                total = b.device.memory_total
                free = max(0, total - self_bytes)
                rows.append([f"  - {b.label} ({b.device.description})", str(total // mib), str(free // mib),
                             str(self_bytes // mib), str(mb["model"] // mib), str(mb["context"] // mib),
                             str(mb["compute"] // mib), str(max(0, total - self_bytes - free) // mib)])
        widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
        for i, r in enumerate(rows):
            c = [r[0].ljust(widths[0])] + [r[j].rjust(widths[j]) for j in range(1, len(r))]
            if i == 0:
                line = f"| {c[0]} | {c[1]}   {c[2]}    {c[3]}   {c[4]}   {c[5]}   {c[6]}    {c[7]} |"
            elif r[1]:
                line = f"| {c[0]} | {c[1]} = {c[2]} + ({c[3]} = {c[4]} + {c[5]} + {c[6]}) + {c[7]} |"
            else:
                line = f"| {c[0]} | {c[1]}   {c[2]}    {c[3]} = {c[4]} + {c[5]} + {c[6]}    {c[7]} |"
            print("llamir_memory_breakdown_print: " + line, file=file or sys.stderr)

    # -- perf -------------------------------------------------------------------------------------
    def perf(self) -> dict[str, float]:
        """llama_perf_context: load/prompt-eval/eval times (ms) and counts, and graph reuses."""
        return self.perf_counters.data()

    def perf_print(self, file=None) -> None:
        self.perf_counters.print(file)

    def perf_reset(self) -> None:
        self.perf_counters.reset()

    @property
    def n_reused(self) -> int:
        return self.perf_counters.n_reused

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

    @property
    def n_seq_max(self) -> int:
        return self.cparams.n_seq_max
