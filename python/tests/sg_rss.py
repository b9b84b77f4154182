"""Resident memory of this process, from Linux /proc, shared by the helper scripts that measure
the peak of training steps (mem_helper.py, step_peak_helper.py)."""


def status_kib(key):
    """A size field of /proc/self/status in KiB: "VmRSS" (resident now), "VmHWM" (its peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak():
    """Resets VmHWM to the current resident set (writes 5 to /proc/self/clear_refs); raises
    OSError where the kernel does not allow it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
