"""Run a command and sample its memory: peak anonymous (private) RSS and peak total RSS.

mmapped checkpoint pages are page cache, reclaimable and shared: RssAnon leaves them out.
"""

from __future__ import annotations

import subprocess
import time


def _status_kib(pid: int) -> tuple[int, int]:
    anon = total = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                total = int(line.split()[1])
    return anon, total


def measure(argv: list[str], env: dict | None = None) -> dict:
    """Wall seconds, peak RssAnon and peak VmRSS (MiB) of one process running `argv`.

    A program that prints `work_seconds=X` (its time after imports) gets that reported too.
    """
    started = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak_anon = peak_total = 0
    while proc.poll() is None:
        try:
            anon, total = _status_kib(proc.pid)
        except (FileNotFoundError, ProcessLookupError):
            break
        peak_anon, peak_total = max(peak_anon, anon), max(peak_total, total)
        time.sleep(0.002)
    stdout, stderr = proc.communicate()
    seconds = time.perf_counter() - started
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {stderr.decode()[-2000:]}")
    work = [float(line.split("=")[1]) for line in stdout.decode().splitlines() if line.startswith("work_seconds=")]
    return {"seconds": seconds, "work_seconds": work[-1] if work else seconds,
            "anon_mib": peak_anon / 1024, "rss_mib": peak_total / 1024}
