"""Run a command and sample its memory: peak anonymous (private) RSS and peak total RSS.

mmapped checkpoint pages are page cache, reclaimable and shared: RssAnon leaves them out.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path


def _status_kib(pid: int) -> tuple[int, int]:
    """RssAnon and VmRSS of `pid` and every process below it, summed: a merge's helper processes (the config
    check's child) count against its memory as much as its own pages."""
    anon = total = 0
    for each in _tree(pid):
        try:
            with open(f"/proc/{each}/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        anon += int(line.split()[1])
                    elif line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):
            if each == pid:
                raise
    return anon, total


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (from /proc/PID/task/TID/children)."""
    found, index = [pid], 0
    while index < len(found):
        for task in Path(f"/proc/{found[index]}/task").glob("*"):
            try:
                found += [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                pass
        index += 1
    return found


def measure(argv: list[str], env: dict | None = None) -> dict:
    """Wall seconds, peak RssAnon and peak VmRSS (MiB) of one process running `argv` (its descendants included).

    A program that prints `work_seconds=X` (its time after imports) gets that reported too.
    """
    # Output goes to files, not pipes: a child that writes more than a pipe holds would block until the end.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err)
        peak_anon = peak_total = 0
        while proc.poll() is None:
            try:
                anon, total = _status_kib(proc.pid)
            except (FileNotFoundError, ProcessLookupError):
                break
            peak_anon, peak_total = max(peak_anon, anon), max(peak_total, total)
            time.sleep(0.002)
        proc.wait()
        seconds = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {stderr.decode()[-2000:]}")
    work = [float(line.split("=")[1]) for line in stdout.decode().splitlines() if line.startswith("work_seconds=")]
    return {"seconds": seconds, "work_seconds": work[-1] if work else seconds,
            "anon_mib": peak_anon / 1024, "rss_mib": peak_total / 1024}


def warm(pattern: str) -> None:
    """Input files (a shell glob) in page cache and no dirty pages left from the previous sample's output;
    this machine reclaims idle page cache proactively, so it runs before every sample."""
    subprocess.run(f"sync && cat {pattern} > /dev/null", shell=True, check=True)


def median_run(label: str, argv: list[str], out: Path, repeat: int, inputs: str, env: dict | None = None) -> dict:
    """Medians of `repeat` samples of `argv` (each after `warm(inputs)`, with `out` removed first and after),
    printed on one line."""
    return alternating_medians({label: (argv, env)}, out, repeat, inputs)[label]


def alternating_medians(contenders: dict[str, tuple[list[str], dict | None]], out: Path, repeat: int,
                        inputs: str) -> dict[str, dict]:
    """Medians of `repeat` rounds, each round one sample of every contender in turn (label -> (argv, env)),
    so a slow stretch of a noisy machine falls on all of them alike; one printed line per contender.

    >>> alternating_medians({"cp": (["cp", "-r", "a", "b"], None)}, Path("b"), 3, "a/*")  # doctest: +SKIP
    """
    samples: dict[str, list[dict]] = {label: [] for label in contenders}
    for _ in range(repeat):
        for label, (argv, env) in contenders.items():
            shutil.rmtree(out, ignore_errors=True)
            warm(inputs)
            samples[label].append(measure(argv, env))
    shutil.rmtree(out, ignore_errors=True)
    medians = {}
    for label, runs in samples.items():
        median = medians[label] = {k: statistics.median(s[k] for s in runs) for k in runs[0]}
        print(f"  {label:<38} {median['seconds']:7.2f} s (after imports {median['work_seconds']:6.2f} s)   "
              f"anon {median['anon_mib']:6.0f} MiB   rss {median['rss_mib']:6.0f} MiB", flush=True)
    return medians
