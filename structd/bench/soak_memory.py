"""The soak's memory watch: peak resident memory of every process of the stack, its workers included.

Each sample walks every service's process tree (the inference server and
its engine core where it runs one; each grammar replica, its compile-worker
zygote, the workers forked from it, and its check workers: "worker" below,
the service's own process "server") and reads VmHWM, the
kernel's own peak RSS of the process since it started, so a peak between
two samples is not missed. A process is kept under its service and role;
a replica restarted by the soak contributes both its lives. A worker that
lived and died between two samples is not seen.
"""

from __future__ import annotations

from pathlib import Path

MIB = 2**20


def descendants(pid: int) -> list[int]:
    """`pid` and every process under it that still runs."""
    out, todo = [], [pid]
    while todo:
        one = todo.pop()
        out.append(one)
        # Every thread's children: a process started from a thread other than the main one (a pool's
        # worker, started by the thread that submitted to it) is listed under that thread only.
        for task in Path(f"/proc/{one}/task").glob("*"):
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except (OSError, ValueError):
                pass  # the thread's: it ended, or has no children file to read
    return out


def _status(pid: int) -> dict[str, int]:
    """VmHWM and VmRSS in bytes; empty once the process is gone."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return {}
    return out


class MemoryWatch:
    """Peak RSS per process, by service, over every sample taken."""

    def __init__(self):
        self.processes: dict[int, dict] = {}  # pid -> {service, role, peak_bytes, rss_bytes}
        self.samples: list[dict] = []  # {t, service -> summed VmRSS of its processes}

    def sample(self, t: float, roots: dict[str, int | None]) -> None:
        """roots: service name -> its server's pid (None while it is down)."""
        totals: dict[str, int | None] = {}
        for service, root in roots.items():
            if root is None:
                totals[service] = None
                continue
            total = 0
            for pid in descendants(root):
                status = _status(pid)
                if not status:
                    continue
                seen = self.processes.setdefault(pid, {"service": service, "role": "server" if pid == root else "worker", "pid": pid,
                                                       "peak_bytes": 0})
                seen["peak_bytes"] = max(seen["peak_bytes"], status.get("VmHWM", 0), status.get("VmRSS", 0))
                total += status.get("VmRSS", 0)
            totals[service] = total
        self.samples.append({"t": round(t, 3), "rss_bytes": totals})

    def figures(self) -> dict:
        """Per service: the largest peak of one process and its role, the largest of a worker, the processes
        seen, and the largest sum of the service's processes' RSS at one sample (forked workers' shared pages
        counted in each); every process's peak."""
        services: dict[str, dict] = {}
        for p in self.processes.values():
            s = services.setdefault(p["service"], {"processes_seen": 0, "peak_process_mib": 0.0,
                                                   "peak_process_role": None, "peak_worker_mib": None,
                                                   "peak_total_mib": 0.0})
            s["processes_seen"] += 1
            if p["role"] == "worker":
                s["peak_worker_mib"] = max(s["peak_worker_mib"] or 0.0, round(p["peak_bytes"] / MIB, 1))
            if p["peak_bytes"] / MIB > s["peak_process_mib"]:
                s["peak_process_mib"], s["peak_process_role"] = round(p["peak_bytes"] / MIB, 1), p["role"]
        for sample in self.samples:
            for service, total in sample["rss_bytes"].items():
                if total is not None and service in services:
                    services[service]["peak_total_mib"] = max(services[service]["peak_total_mib"],
                                                              round(total / MIB, 1))
        return {"by_service": services,
                "processes": [{**p, "peak_mib": round(p.pop("peak_bytes") / MIB, 1)}
                              for p in (dict(q) for q in self.processes.values())],
                "samples": self.samples}
