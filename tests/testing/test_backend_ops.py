"""test-backend-ops (llamir.testing.backend_ops): every op has a case, the reference backends pass
it, a broken backend fails it (and the CLI says so), and the CLI prints ggml's lines."""

from __future__ import annotations

import numpy as np
import pytest

from llamir.backends.numpy import NumpyBackend
from llamir.cli import main
from llamir.ir import F32, I32, ops
from llamir.testing import backend_ops
from llamir.testing.backend_ops import (
    FAIL,
    NOT_SUPPORTED,
    OK,
    all_cases,
    compare,
    run_backend_ops,
    uncovered_ops,
)
from llamir.testing.backend_ops_cases import UNCOVERED, WEIGHT_TYPES


def test_every_op_has_a_case_or_a_reason():
    """A newly registered op without a case (or a reason in UNCOVERED) fails here."""
    missing = {name: why for name, why in uncovered_ops().items() if not why}
    assert not missing, f"ops without a test-backend-ops case or a reason in UNCOVERED: {sorted(missing)}"
    assert set(uncovered_ops()) == set(UNCOVERED), "UNCOVERED lists ops that now have cases"
    assert {case.op for case in all_cases()} <= set(ops.OPS)


def test_every_weight_type_is_tested_for_the_weight_ops():
    for op in ("mul_mat", "mul_mat_id", "get_rows"):
        types = {case.graph.leafs[0].dtype for case in all_cases([op])}
        assert set(WEIGHT_TYPES) <= types, (op, set(WEIGHT_TYPES) - types)


def test_cases_are_deterministic():
    case = all_cases(["mul_mat"])[0]
    first, second = (case.inputs(np.random.default_rng(5)) for _ in range(2))
    assert all(np.array_equal(first[k], second[k]) for k in first)


def test_numpy_fast_passes_every_case():
    report = run_backend_ops("numpy-fast")
    assert report.ok, "\n".join(r.line() for r in report.failures)
    assert report.n_supported == len(report.results) == len(all_cases())


def test_sim_device_spec_runs_what_it_claims():
    report = run_backend_ops("sim:gpu0:ops=mul_mat,add", ops=["mul_mat", "add", "rms_norm"])
    by_op = {}
    for r in report.results:
        by_op.setdefault(r.op, set()).add(r.status)
    assert by_op == {"mul_mat": {OK}, "add": {OK}, "rms_norm": {NOT_SUPPORTED}}
    assert report.ok and report.summary() == f"{report.n_passed}/{report.n_passed} tests passed"


class PerturbedRmsNorm(NumpyBackend):
    """Wrong on purpose: adds 1e-3 to the outputs of every graph that holds an rms_norm."""

    def compile(self, graph):
        run = super().compile(graph)
        if not any(n.is_op(ops.RmsNorm) for n in graph.nodes):
            return run
        return lambda values, bindings, observe=None: {k: v + np.float32(1e-3)
                                                       for k, v in run(values, bindings).items()}


class FailingCompile(NumpyBackend):
    def compile(self, graph):
        raise RuntimeError("no kernel for you")


def test_a_perturbed_op_fails_and_nothing_else():
    report = run_backend_ops(PerturbedRmsNorm(), ops=["rms_norm", "norm", "add"])
    failed = {r.op for r in report.failures}
    assert failed == {"rms_norm"} and not report.ok
    bad = report.failures[0]
    assert bad.error > bad.bound and "NMSE" in bad.line() and bad.line().endswith("FAIL")


def test_a_backend_error_is_a_failure_that_names_it():
    report = run_backend_ops(FailingCompile(), ops=["scale"])
    assert all(r.status == FAIL and "no kernel for you" in r.message for r in report.results)


def test_cli_exits_nonzero_for_a_broken_backend(monkeypatch, capsys):
    real = backend_ops.resolve_backend
    monkeypatch.setattr(backend_ops, "resolve_backend",
                        lambda name: PerturbedRmsNorm() if name == "broken-rms" else real(name))
    assert main(["test-backend-ops", "-b", "broken-rms", "-o", "rms_norm", "-o", "add"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("  RMS_NORM(") and line.endswith("FAIL") for line in out)
    assert out[-1] == "Backend broken-rms: FAIL"


def test_cli_output_format(capsys):
    assert main(["test-backend-ops", "-b", "numpy", "-o", "add", "-o", "get_rows"]) == 0
    lines = capsys.readouterr().out.splitlines()
    n = len(all_cases(["add", "get_rows"]))
    cases = [line for line in lines if line.startswith("  ADD(") or line.startswith("  GET_ROWS(")]
    assert len(cases) == n and all(line.endswith(" OK") for line in cases)
    assert "  ADD(type=f32,ne_a=[7,33],ne_b=[33]): NMSE = 0.000000000 <= 0.000000100 OK" in cases
    assert lines[-2].startswith(f"  {n}/{n} tests passed") and lines[-1] == "Backend numpy: OK"


def test_cli_sim_spec_and_not_supported(capsys):
    assert main(["test-backend-ops", "-b", "sim:gpu0:ops=add", "-o", "add", "-o", "sub"]) == 0
    out = capsys.readouterr().out
    assert "  SUB(type=f32,ne_a=[1,1],ne_b=[1,1]): not supported" in out
    n = len(all_cases(["add"]))
    assert f"{n}/{n} tests passed" in out


@pytest.mark.parametrize("argv,message", [(["-b", "no-such-backend"], "unknown backend 'no-such-backend'"),
                                          (["-b", "numpy", "-o", "no_such_op"], "unknown op no_such_op")])
def test_cli_unknown_backend_or_op(capsys, argv, message):
    assert main(["test-backend-ops", *argv]) == 2
    assert message in capsys.readouterr().err


def test_perf_mode_reports_time_and_rate(capsys):
    report = run_backend_ops("numpy-fast", ops=["mul_mat", "add"], mode="perf", perf_seconds=0.0)
    assert report.ok and all(r.us_per_run > 0 and r.n_runs >= 1 for r in report.results)
    for r in report.results:
        assert "us/run" in r.line() and ("GFLOPS" if r.op == "mul_mat" else "GB/s") in r.line(), r.line()
    assert main(["test-backend-ops", "-b", "numpy", "-o", "scale", "--mode", "perf", "--perf-time", "0"]) == 0
    assert "GB/s" in capsys.readouterr().out


def test_compare_follows_ggml_on_nan_inf_and_ints():
    want = np.array([1.0, np.inf, -2.0], np.float32)
    assert compare(want.copy(), want, F32) == (0.0, "")
    assert "NaN" in compare(np.array([1.0, np.inf, np.nan], np.float32), want, F32)[1]
    assert "inf mismatch" in compare(np.array([1.0, -np.inf, -2.0], np.float32), want, F32)[1]
    assert "inf mismatch" in compare(np.array([np.inf, np.inf, -2.0], np.float32), want, F32)[1]
    err, message = compare(np.array([1.1, np.inf, -2.0], np.float32), want, F32)
    assert not message and err == pytest.approx(0.01 / 5.0, rel=1e-5)
    assert compare(np.array([1, 2], np.int32), np.array([1, 3], np.int32), I32)[1] == "1 of 2 values differ"
