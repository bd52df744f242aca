"""The scheduler, after ggml_backend_sched: node assignment, splits and copies, the plan,
ggml-alloc and the compute buffers, the split executor, the cost model and the split picture."""

from llamir.sched.plan import Cause, InputCopy, SchedError, Split, SplitPlan, TensorBuffer
from llamir.sched.scheduler import Pins, ScheduledGraph, Scheduler

__all__ = ["Cause", "InputCopy", "Pins", "SchedError", "ScheduledGraph", "Scheduler", "Split", "SplitPlan",
           "TensorBuffer"]
