"""test-backend-ops for any llamir backend (after ggml's tests/test-backend-ops.cpp).

Every op runs over shapes, dtypes (every weight type for mul_mat, mul_mat_id, get_rows),
views, non-contiguous and broadcast inputs on a backend, through its public interface only
(`supports_op`, `compile`), against the numpy reference interpreter (exact=True), with
ggml's per-op NMSE bounds. `mode="perf"` times each case instead (us/run, GFLOPS or GB/s).

    report = run_backend_ops("llvm", ops=["mul_mat"])
    assert report.ok, report.summary()
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from llamir.backends import Backend, BackendError, backend_from_spec, get_backend
from llamir.ir import Interpreter, ops
from llamir.ir.interp_kernels import to_f32
from llamir.testing import backend_ops_cases as elementwise
from llamir.testing import backend_ops_cases_nn as nn
from llamir.testing import backend_ops_cases_ssm as ssm
from llamir.testing.backend_ops_cases import UNCOVERED, Case

OK, FAIL, NOT_SUPPORTED = "OK", "FAIL", "not supported"
CASE_GROUPS: tuple[Callable[[], Iterator[Case]], ...] = (
    elementwise.unary_cases, elementwise.binary_cases, elementwise.glu_cases, elementwise.scalar_cases,
    elementwise.norm_cases, elementwise.reduce_cases, elementwise.argmax_cases, elementwise.cumsum_cases,
    nn.layout_cases, nn.cpy_cases, nn.rows_cases,
    nn.mul_mat_cases, nn.mul_mat_id_cases, nn.rope_cases, nn.soft_max_cases, nn.attention_cases,
    ssm.ssm_conv_cases, ssm.ssm_scan_cases,
)


@dataclass
class CaseResult:
    """One case on one backend: status OK / FAIL / not supported, the error (NMSE, or the
    number of differing values for bound 0) against its bound, or why it failed; in perf mode
    the time per run and the rate."""

    op: str
    params: str
    status: str
    error: float | None = None
    bound: float | None = None
    message: str = ""
    us_per_run: float | None = None
    n_runs: int = 0
    flops: int = 0
    nbytes: int = 0

    @property
    def name(self) -> str:
        return f"{self.op.upper()}({self.params})"

    def line(self) -> str:
        """One line as ggml prints it."""
        if self.status == NOT_SUPPORTED:
            return f"  {self.name}: not supported"
        if self.us_per_run is not None and self.status == OK:
            rate = (f"{self.flops / 1e6:10.2f} MFLOP/run - {self.flops / self.us_per_run / 1e3:8.2f} GFLOPS"
                    if self.flops else f"{self.nbytes / 1024:8.1f} kB/run - "
                    f"{self.nbytes / self.us_per_run / 1e3:8.2f} GB/s")
            return f"  {self.name}: {self.n_runs:8d} runs - {self.us_per_run:10.2f} us/run - {rate}"
        detail = f" {self.message}" if self.message else ""
        if self.error is not None:
            detail = f" NMSE = {self.error:.9f} <= {self.bound:.9f}" if self.status == OK else \
                f" NMSE = {self.error:.9f} > {self.bound:.9f}{detail}"
        return f"  {self.name}:{detail} {self.status}"


@dataclass
class Report:
    """Every case's result on one backend."""

    backend: str
    mode: str
    results: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if r.status == FAIL]

    @property
    def n_supported(self) -> int:
        return sum(1 for r in self.results if r.status != NOT_SUPPORTED)

    @property
    def n_passed(self) -> int:
        return sum(1 for r in self.results if r.status == OK)

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        return f"{self.n_passed}/{self.n_supported} tests passed"


def all_cases(op_names: Iterable[str] | None = None) -> list[Case]:
    """The cases of the named ops (all ops when None); ValueError for an unknown op name."""
    cases = [case for group in CASE_GROUPS for case in group()]
    if op_names is None:
        return cases
    wanted = set(op_names)
    unknown = sorted(wanted - set(ops.OPS))
    if unknown:
        raise ValueError(f"unknown op {', '.join(unknown)}; known: {', '.join(sorted(ops.OPS))}")
    return [case for case in cases if case.op in wanted]


def uncovered_ops() -> dict[str, str]:
    """Registered ops without a case, with the reason (a new op must get a case or a reason here)."""
    covered = {case.op for case in all_cases()}
    return {name: UNCOVERED.get(name, "") for name in ops.OPS if name not in covered}


def resolve_backend(backend: Backend | str) -> Backend:
    """A Backend instance, or one made from a registered name or a device spec (sim:gpu0)."""
    if isinstance(backend, Backend):
        return backend
    try:
        return get_backend(backend)
    except BackendError as first:
        try:
            return backend_from_spec(backend)
        except (BackendError, ValueError):
            raise BackendError(str(first)) from None


def run_backend_ops(backend: Backend | str, ops: list[str] | None = None, mode: str = "eval", *,
                    cases: list[Case] | None = None, seed: int = 0, perf_seconds: float = 0.25,
                    on_result: Callable[[CaseResult], None] | None = None) -> Report:
    """Run the cases of `ops` (all when None; or exactly `cases`) on `backend`: eval compares with
    the numpy reference, perf times each supported case for about `perf_seconds`."""
    if mode not in ("eval", "perf"):
        raise ValueError(f"mode must be 'eval' or 'perf', got {mode!r}")
    be = resolve_backend(backend)
    todo = cases if cases is not None else all_cases(ops)
    reference = Interpreter(exact=True, numerics=getattr(be, "numerics", None))
    report = Report(getattr(be, "label", be.name), mode)
    t0 = time.perf_counter()
    supported = [case for case in todo if all(be.supports_op(node) for node in case.tested_nodes())]
    be.precompile([case.graph for case in supported], [dict(case.bindings) for case in supported])
    for case in todo:
        result = run_case(be, case, reference, mode, seed, perf_seconds)
        report.results.append(result)
        if on_result is not None:
            on_result(result)
    report.seconds = time.perf_counter() - t0
    return report


def case_seed(case: Case, seed: int) -> int:
    return zlib.crc32(f"{seed}|{case.name}".encode())


def run_case(backend: Backend, case: Case, reference: Interpreter, mode: str = "eval", seed: int = 0,
             perf_seconds: float = 0.25) -> CaseResult:
    """One case on `backend`; any error of the backend is a FAIL that names it."""
    result = CaseResult(case.op, case.params, OK, bound=case.max_nmse)
    if not all(backend.supports_op(node) for node in case.tested_nodes()):
        result.status, result.bound = NOT_SUPPORTED, None
        return result
    values = case.inputs(np.random.default_rng(case_seed(case, seed)))
    try:
        run = backend.compile(case.graph)
        ours = {name: v.copy() for name, v in values.items()}
        if mode == "perf":
            return _perf(run, case, ours, result, perf_seconds)
        got = run(ours, dict(case.bindings))
    except Exception as err:  # noqa: BLE001 - a backend's failure, whatever it raises, is this case's FAIL
        result.status, result.message = FAIL, f"{type(err).__name__}: {err}"
        return result
    theirs = {name: v.copy() for name, v in values.items()}
    want = reference.run(case.graph, theirs, dict(case.bindings))
    pairs = [(name, got.get(name), want[name], node.dtype) for name, node in case.graph.outputs.items()]
    pairs += [(name, ours[name], theirs[name], leaf.dtype) for leaf in case.graph.leafs
              if (name := leaf.name) in case.state]
    worst = 0.0
    for name, actual, expected, dtype in pairs:
        error, message = compare(actual, expected, dtype)
        if message:
            result.status, result.message = FAIL, f"{name}: {message}"
            return result
        worst = max(worst, error)
    result.error = worst
    if worst > case.max_nmse:
        result.status = FAIL
    return result


def compare(actual, expected: np.ndarray, dtype) -> tuple[float, str]:
    """(NMSE, "") of float values (as ggml: NaN anywhere fails, infinities must match in sign);
    (0, "") or (count, message) for ints, which must be equal."""
    if actual is None:
        return 0.0, "missing from the backend's outputs"
    actual = np.asarray(actual)
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return 0.0, f"got {actual.shape} {actual.dtype}, expected {expected.shape} {expected.dtype}"
    if dtype.is_int:
        differ = int(np.count_nonzero(actual != expected))
        return (0.0, "") if not differ else (float(differ), f"{differ} of {actual.size} values differ")
    a = to_f32(np.ascontiguousarray(actual), dtype).astype(np.float64).ravel()
    b = to_f32(np.ascontiguousarray(expected), dtype).astype(np.float64).ravel()
    for what, values in (("backend", a), ("reference", b)):
        if np.isnan(values).any():
            return 0.0, f"NaN at index {int(np.flatnonzero(np.isnan(values))[0])} ({what})"
    big = float(np.finfo(np.float32).max)
    inf_a, inf_b = np.abs(a) >= big, np.abs(b) >= big
    if (inf_a != inf_b).any() or (np.sign(a[inf_a]) != np.sign(b[inf_b])).any():
        i = int(np.flatnonzero((inf_a != inf_b) | (inf_a & (np.sign(a) != np.sign(b))))[0])
        return 0.0, f"inf mismatch at index {i}: backend {a[i]}, reference {b[i]}"
    a, b = a[~inf_a], b[~inf_b]
    err = float(np.sum((a - b) ** 2))
    if err == 0.0:
        return 0.0, ""
    return err / max(float(np.sum(b * b)), 1e-300), ""


def _perf(run, case: Case, values: dict, result: CaseResult, seconds: float) -> CaseResult:
    """ggml's perf loop: a warm-up run, then runs until `seconds` have passed (at least one)."""
    bindings = dict(case.bindings)
    run(values, bindings)
    n_runs, elapsed = 0, 0.0
    while elapsed < seconds or n_runs == 0:
        t0 = time.perf_counter()
        run(values, bindings)
        elapsed += time.perf_counter() - t0
        n_runs += 1
    result.us_per_run, result.n_runs = elapsed / n_runs * 1e6, n_runs
    result.flops, result.nbytes = case.flops, op_bytes(case, values)
    result.error = result.bound = None
    return result


def op_bytes(case: Case, values: dict) -> int:
    """ggml's op_size: bytes of the result and of every leaf read."""
    out = sum(int(np.prod(n.type.evaluate(case.bindings))) * n.dtype.type_size // n.dtype.block_size
              for n in case.graph.outputs.values())
    return out + sum(int(v.nbytes) for v in values.values())
