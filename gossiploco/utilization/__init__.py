"""The compute-utilization simulator: the paper's section 5.2, Figure 3 and Table 1's "Compute Util." columns.

``model`` is the simulator itself, its equations in the docstring: what a configuration sends
(``MixLoad``, ``CommPlan``), the scenario (``Scenario``), and ``simulate``, the expected time of one
round on one peer (``RoundTime``). ``inputs`` fills those in from a run config and the command line
(``comm_plan``, ``resolve_scenario``, ``preset_plans``); ``report`` shows a result (a JSON object,
lines for a terminal, utilization against bandwidth as a plot).
"""

from gossiploco.utilization.inputs import (
    BYTES_PER_VALUE_NAMES,
    FLOPS_PER_PARAM_TOKEN,
    block_fraction,
    block_sizes,
    comm_plan,
    compression_scale,
    default_vocab_size,
    estimate_step_time,
    monitors_per_round,
    parse_bytes_per_value,
    preset_plans,
    resolve_scenario,
)
from gossiploco.utilization.model import (
    CommPlan,
    MixLoad,
    RoundTime,
    Scenario,
    attempt_seconds,
    expected_attempts,
    expected_overrun,
    restarts,
    simulate,
    wire_factor,
)
from gossiploco.utilization.report import describe, plot_bandwidth_sweep, report

__all__ = [
    "BYTES_PER_VALUE_NAMES",
    "FLOPS_PER_PARAM_TOKEN",
    "CommPlan",
    "MixLoad",
    "RoundTime",
    "Scenario",
    "attempt_seconds",
    "block_fraction",
    "block_sizes",
    "comm_plan",
    "compression_scale",
    "default_vocab_size",
    "describe",
    "estimate_step_time",
    "expected_attempts",
    "expected_overrun",
    "monitors_per_round",
    "parse_bytes_per_value",
    "plot_bandwidth_sweep",
    "preset_plans",
    "report",
    "resolve_scenario",
    "restarts",
    "simulate",
    "wire_factor",
]
