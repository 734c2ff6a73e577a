"""Resident memory of this process, read from /proc (Linux): for the benchmarks."""


def rss() -> tuple[int, int]:
    """(current, peak) resident bytes: VmRSS and VmHWM."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    return int(fields["VmRSS"][0]) * 1024, int(fields["VmHWM"][0]) * 1024


def reset_peak() -> None:
    """Resets the kernel's peak mark (VmHWM) to the current resident memory."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
