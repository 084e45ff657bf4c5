"""Where a figure was measured: the machine record every benchmark writes beside its numbers (``measured_on``).

A time, a speedup or an MFU means little without the machine: the CPU model and its logical cores, the torch threads
the measurement ran with, the torch build, the accelerator (``cpu`` when none) and the date (UTC). The workbench's
report compares a figure's record with the machine it runs on (:func:`same_machine`: CPU model and cores) to say
whether a benchmark figure was measured here or is the committed one from another machine.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess

UNKNOWN = "unknown (before provenance)"
"""What a figure measured before its benchmark wrote ``measured_on`` records for each field."""

FIELDS = ("cpu", "logical_cores", "torch_threads", "torch", "device", "date")


def cpu_model() -> str:
    """The CPU's model name: ``/proc/cpuinfo``'s ``model name`` (Linux x86), the brand string (macOS), else
    ``platform.processor()`` or the architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5, check=False
            )
            if out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown"


def device_name(device=None) -> str:
    """``cpu``, or the CUDA device's name (``device``, else the current CUDA device when there is one)."""
    import torch  # the leaf module stays importable without it for the report's comparisons

    if device is not None and torch.device(device).type != "cuda":
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(device)


def machine(device=None, *, threads: int | None = None) -> dict:
    """This machine, now: {cpu, logical_cores, torch_threads, torch, device, date}. ``threads``: the torch threads
    the measurement ran with, when not this process's current setting."""
    import torch

    return {
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads() if threads is None else threads,
        "torch": torch.__version__,
        "device": device_name(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def unknown(**known) -> dict:
    """The record of a figure measured before provenance: every field :data:`UNKNOWN` but those ``known``."""
    return {**dict.fromkeys(FIELDS, UNKNOWN), **known}


def same_machine(a: dict | None, b: dict | None) -> bool | None:
    """Whether two records name the same machine (CPU model and logical cores); None when either does not say."""
    if not a or not b:
        return None
    keys = ("cpu", "logical_cores")
    if any(a.get(k) in (None, UNKNOWN) or b.get(k) in (None, UNKNOWN) for k in keys):
        return None
    return all(a[k] == b[k] for k in keys)


def describe(record: dict | None) -> str:
    """One line: ``AMD EPYC, 2 logical cores, 1 torch thread(s), torch 2.13.0+cpu, cpu, 2026-12-01T12:36:51+00:00``;
    fields a record does not know are left out (``an unrecorded CPU`` when it does not know the CPU)."""
    record = record or {}

    def known(key: str) -> bool:
        return record.get(key) not in (None, UNKNOWN, "")

    if not any(known(k) for k in FIELDS):
        return UNKNOWN
    parts = [str(record["cpu"]) if known("cpu") else "an unrecorded CPU (before provenance)"]
    parts += [f"{record['logical_cores']} logical cores"] if known("logical_cores") else []
    parts += [f"{record['torch_threads']} torch thread(s)"] if known("torch_threads") else []
    parts += [f"torch {record['torch']}"] if known("torch") else []
    parts += [str(record["device"])] if known("device") else []
    parts += [str(record["date"])] if known("date") else []
    return ", ".join(parts)
