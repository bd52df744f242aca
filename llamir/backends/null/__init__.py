"""The null backend: a GPU-like device that claims every op and runs nothing.

It lets CI walk every multi-device path of the scheduler (assignment, copies, allocation,
events) without hardware; the values it leaves behind are whatever its buffers held (zeros).
"""

from __future__ import annotations

from llamir.backends.base import Backend, Device, DeviceCaps, DeviceType

NULL_MEMORY = 1 << 40


class NullBackend(Backend):
    """Supports every op and buffer of its own; compute is a no-op."""

    name = "null"

    def __init__(self, device_name: str = "null", memory: int = NULL_MEMORY):
        super().__init__(Device(
            device_name,
            DeviceType.GPU,
            memory,
            "claims every op, runs nothing",
            caps=DeviceCaps(async_=True, events=True),
            alignment=128,
        ))

    def supports_op(self, node) -> bool:
        return True

    def offload_op(self, node) -> bool:
        return False

    def compile(self, graph):
        def run(leaf_values, bindings, observe=None):
            return {}

        return run

    def graph_compute(self, run, memory, observe=None) -> bool:
        self.stats.n_graph_computes += 1
        return True
