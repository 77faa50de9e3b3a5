"""qkiln's on/off environment switches (QKILN_NATIVE_CPU, QKILN_DECODE_STACK, ...): 1 or 0; unset or
empty for the default. Anything else is refused, naming the switch: `QKILN_NATIVE_CPU=false` had
compiled the kernels it meant to skip (only "0" switched them off)."""

import os

from qkiln.errors import QkilnError

# Read by the compiled kernels at each call (plugins/csrc/qkiln_cpu.h, switched_off: "0" is off), so
# one process can time both sides: checked when the kernels load.
KERNEL_SWITCHES = ("QKILN_DECODE_SPLIT", "QKILN_GROUP_DECODE", "QKILN_TILED_PREFILL", "QKILN_AMX_PREFILL",
                   "QKILN_FIXED16")


def env_switch(name: str, default: bool) -> bool:
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value not in ("0", "1"):
        raise QkilnError(f"{name}={value!r}: qkiln's switches take 1 (on) or 0 (off); unset it for the default")
    return value == "1"


def check_kernel_switches() -> None:
    for name in KERNEL_SWITCHES:
        env_switch(name, True)
