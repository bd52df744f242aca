"""Pass pipelines written as strings: "dce,cse,fuse-rms-norm".

    changed = run_pipeline(graph, "fuse-rms-norm,dce", verify_each=True)

Each name is a registered GraphPass (see PASSES); `verify_each` runs the IR verifier after every
pass and names the pass that broke the graph.
"""

from __future__ import annotations

from llamir.ir import Graph, verify
from llamir.ir.verifier import VerifyError
from llamir.passes.base import PASSES, GraphPass


class PipelineError(ValueError):
    """A pipeline string that names an unknown pass."""


def _load_builtin_passes() -> None:
    # The modules register their passes on import.
    from llamir.passes import decompose, fusion, simplify  # noqa: F401


class PassPipeline:
    """An ordered list of passes, parsed from a comma-separated string of pass names."""

    def __init__(self, spec: str | list[GraphPass]):
        if isinstance(spec, str):
            _load_builtin_passes()
            names = [n.strip() for n in spec.split(",") if n.strip()]
            unknown = [n for n in names if n not in PASSES]
            if unknown:
                known = ", ".join(sorted(PASSES))
                raise PipelineError(f"unknown pass {unknown[0]!r} in {spec!r}; known: {known}")
            self.passes: list[GraphPass] = [PASSES[n]() for n in names]
        else:
            self.passes = list(spec)

    def run(self, graph: Graph, verify_each: bool = False) -> bool:
        """Run every pass in order; returns whether any changed the graph."""
        changed = False
        for p in self.passes:
            changed |= bool(p.run(graph))
            if verify_each:
                try:
                    verify(graph)
                except VerifyError as err:
                    raise VerifyError(f"after pass {p.name}: {err}") from None
        return changed

    def __str__(self) -> str:
        return ",".join(p.name for p in self.passes)


def run_pipeline(graph: Graph, spec: str, verify_each: bool = False) -> bool:
    """Parse `spec` and run it on `graph` in place."""
    return PassPipeline(spec).run(graph, verify_each=verify_each)
