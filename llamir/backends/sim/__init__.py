"""Simulated devices: claim a chosen set of ops, run them through numpy (so results are real),
count every byte copied in and out, and carry a cost model for split-plan estimates.

    SimBackend(SimSpec("gpu0", ops=frozenset({"mul_mat", "add"}), mem=2 << 30))
    SimBackend.from_spec("sim:gpu0:ops=mul_mat,add:mem=2GiB")
"""

from __future__ import annotations

from collections.abc import Callable

from llamir.backends.base import Device, DeviceCaps, DeviceType, op_batch_size
from llamir.backends.numpy import NumpyBackend
from llamir.backends.sim.spec import SimSpec, SpecError, format_size, parse_sim_spec
from llamir.backends.support import SupportTable, float_types
from llamir.ir import Node

__all__ = ["SimBackend", "SimSpec", "SpecError", "format_size", "parse_sim_spec"]


class SimBackend(NumpyBackend):
    """A simulated GPU (or, with host=True, an accelerator computing in host memory)."""

    name = "sim"

    def __init__(self, spec: SimSpec | None = None, predicate: Callable[[Node], bool] | None = None):
        spec = spec if spec is not None else SimSpec()
        kind = DeviceType.ACCEL if spec.host else DeviceType.GPU
        super().__init__(
            Device(
                spec.name,
                kind,
                spec.mem,
                spec.describe(),
                caps=DeviceCaps(async_=spec.async_, events=spec.events),
                alignment=spec.align,
                host_memory=spec.host,
            )
        )
        self.spec = spec
        self.predicate = predicate
        self.cost_model = spec.cost
        self.support = self.support_table(spec, predicate)

    @staticmethod
    def support_table(spec: SimSpec, predicate: Callable[[Node], bool] | None = None) -> SupportTable:
        """The numpy table cut down to the spec's ops and float types, and the caller's predicate."""
        table = NumpyBackend().support
        if spec.ops is not None:
            table = table.only(spec.ops & set(table.op_names()))
        if spec.types is not None:
            table = table.where(float_types(spec.types))
        return table.where(predicate) if predicate is not None else table

    @classmethod
    def from_spec(cls, text: str, predicate: Callable[[Node], bool] | None = None) -> SimBackend:
        return cls(parse_sim_spec(text), predicate)

    def supports_op(self, node: Node) -> bool:
        return self.support(node)

    def offload_op(self, node: Node) -> bool:
        threshold = self.spec.offload_batch
        return threshold is not None and op_batch_size(node) >= threshold

    def __repr__(self) -> str:
        return f"<backend {self.spec.describe()}>"
