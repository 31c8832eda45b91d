"""The light request path, measured and profiled process by process (issue 31 item 1).

  python bench/profile_path.py                       # this tree vs KServe, echo c16, 3 rounds
  python bench/profile_path.py --tree base=/tmp/base --tree lean=. --rounds 5
                                                     # two poolserve sources side by side
  python bench/profile_path.py --profile py-spy      # also a py-spy profile of every process
  python bench/profile_path.py --inline              # also the inline echo (no worker)
  python bench/profile_path.py --routers2            # also each tree with routers: 2

A ``--tree LABEL=DIR`` is a source folder holding service/, protos/ and supervisor/ (a
checkout of this repository, or ``git archive <commit> service protos supervisor``
unpacked into DIR): its tree runs from .venv's python with those sources first on the
import path (a folder ``poolserve`` linking to them is made under bench/.peers/work).
Every server is started once and measured in interleaved rounds (perf_analyzer, FP32
[1,16], concurrency 16): throughput, and CPU per request by process role (router,
pool server, worker; KServe's one process) read from /proc before and after each cell.
Ratios are per round (poolserve over KServe in the same round), then the median.

``--profile py-spy``: after the rounds, one more cell per poolserve tree with
``py-spy record --nonblocking --format raw`` attached to every process of the tree;
prints the top self-time functions per role and keeps the raw (collapsed) stacks
under bench/.peers/work/profile-*/.  Never publishes anything.
"""

from __future__ import annotations

import argparse
import collections
import os
import pstats
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import install
import large_tensors
import perf
import servers

ROOT = Path(__file__).resolve().parent.parent
WORK = install.PEERS / "work"
PY_SPY = ROOT / ".venv" / "bin" / "py-spy"


@dataclass
class Subject:
    label: str
    spec: servers.ServerSpec
    source: Path | None  # None: KServe (or .venv's own poolserve)
    running: servers.Running | None = None


# Imported by every process of a tree started from a shim (Python imports sitecustomize
# from the path): in the router and the pool server, SIGUSR1 starts cProfile and SIGUSR2
# stops it and writes its stats to $PROFILE_PATH_OUT/<role>-<pid>.prof. A forked child
# (the zygote, the workers) drops the profiler and the handlers. Bench only.
SITECUSTOMIZE = """
import os, signal, sys
_out = os.environ.get("PROFILE_PATH_OUT")
_role = sys.argv[1] if len(sys.argv) > 1 else ""
if _out and _role in ("router", "pool"):
    import cProfile
    _profiler = cProfile.Profile()

    def _start(signum, frame):
        _profiler.enable()

    def _stop(signum, frame):
        _profiler.disable()
        _profiler.dump_stats(os.path.join(_out, f"{_role}-{os.getpid()}.prof"))

    def _child():
        _profiler.disable()
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
    os.register_at_fork(after_in_child=_child)
"""


def shim(label: str, source: Path) -> Path:
    """A folder with ``poolserve/{service,protos,supervisor}`` linking to ``source``,
    and the cProfile hook (:data:`SITECUSTOMIZE`)."""
    top = WORK / f"src-{label}"
    pkg = top / "poolserve"
    shutil.rmtree(top, ignore_errors=True)
    pkg.mkdir(parents=True)
    for name in ("service", "protos", "supervisor"):
        (pkg / name).symlink_to((source / name).resolve())
    (top / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return top


@dataclass(frozen=True)
class Load:
    """What a cell sends: echo FP32 [1,16], or (``--large``) the 9.2 MiB echo of
    bench/large_tensors.py, read from its input data file."""

    shape: tuple[int, ...] | None = None  # the echo model's declared shape; None: [1, 16]
    dims: str | None = None  # perf_analyzer's --shape
    extra: tuple[str, ...] = ()


LOAD = Load()


def start(subject: Subject, run_dir: Path, venvs: dict[str, Path]) -> servers.Running:
    layout = servers.Layout(models=("echo",), shape=LOAD.shape)
    workdir = run_dir / subject.label
    load = servers.Workload(1, workdir / "burn.count")
    ctx = servers.Context(workdir, servers.free_port(), load, layout, venvs, servers.free_port())
    spec = subject.spec
    if subject.source is not None:
        path = str(shim(subject.label, subject.source))
        build = spec.build

        def with_path(s: servers.ServerSpec, c: servers.Context) -> servers.Launch:
            launch = build(s, c)
            env = {**launch.env, "PYTHONPATH": path, "PROFILE_PATH_OUT": str(workdir)}
            return replace(launch, env=env)

        spec = replace(spec, build=with_path)
    server = servers.start(spec, ctx)
    try:
        servers.wait_line(server, timeout=120)
        ready = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "client.py"), "ready", server.address,
             "--models", "echo", "--timeout", "120", "--warm", "0" if LOAD.shape else "3"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if '"ready": true' not in ready.stdout:
            raise RuntimeError(f"{subject.label} not ready: {ready.stdout} {ready.stderr}")
    except BaseException:
        servers.stop(server)  # by PID, what it started too
        raise
    return server


def roles(server: servers.Running) -> dict[int, str]:
    """PID -> role. poolserve: supervisor (the root), router, pool (the supervisor's
    other children), zygote (a pool's child with children of its own), worker (the
    zygote's children); any other server: server."""
    pids = server.tree()
    if not server.spec.key.startswith("poolserve"):
        return dict.fromkeys(pids, "server")
    parent = {pid: _ppid(pid) for pid in pids}
    root = server.process.pid
    out: dict[int, str] = {}
    for pid in pids:
        if pid == root:
            out[pid] = "supervisor"
        elif parent[pid] == root:
            out[pid] = "router" if b"router" in _cmdline(pid)[:6] else "pool"
        elif any(parent[other] == pid for other in pids):
            out[pid] = "zygote"
        else:
            out[pid] = "worker"
    return out


def _cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def cpu_by_role(server: servers.Running) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for pid, role in roles(server).items():
        out[role] += servers.cpu_seconds(pid)
    return dict(out)


def switches_by_role(server: servers.Running) -> dict[str, int]:
    """Context switches (voluntary: the thread slept; and involuntary) of every
    thread of every process, by role: how often a request wakes something."""
    out: dict[str, int] = collections.defaultdict(int)
    for pid, role in roles(server).items():
        for status in Path(f"/proc/{pid}/task").glob("*/status"):
            try:
                text = status.read_text()
            except OSError:
                continue
            for line in text.splitlines():
                if "ctxt_switches:" in line:
                    out[role] += int(line.split(":", 1)[1])
    return dict(out)


def cell(
    subject: Subject, pa: install.PerfAnalyzer, window_ms: int, out: Path, concurrency: int
) -> dict[str, Any]:
    server = subject.running
    assert server is not None
    before, began = cpu_by_role(server), time.monotonic()
    woken = switches_by_role(server)
    busy, ours = servers.machine_busy_seconds(), _ours()
    split: list[int] = []  # the client's connections per router, read 2 s into the cell
    peek = threading.Timer(2.0, lambda: split.extend(connections_by_router(server)))
    peek.start()
    result = perf.run(pa.binary, {**os.environ, **pa.env}, server.address, "echo", concurrency,
                      window_ms, out / f"{subject.label}.csv", 300, LOAD.dims,
                      LOAD.extra)  # fmt: skip
    wall = time.monotonic() - began
    after = cpu_by_role(server)
    switched = switches_by_role(server)
    spent = (_ours() - ours) + sum(after.values()) - sum(before.values())
    foreign = max(0.0, servers.machine_busy_seconds() - busy - spent) / wall
    requests = result.throughput * wall
    per = {k: 1000 * (after[k] - before.get(k, 0.0)) / requests for k in after}
    per["total"] = sum(per.values())
    switches = {k: (switched[k] - woken.get(k, 0)) / requests for k in switched}
    switches["total"] = sum(switches.values())
    peek.join()
    return {"throughput": result.throughput, "p99_ms": result.p99_us / 1000, "cpu_ms": per,
            "foreign_cores": foreign, "requests": requests, "switches": switches,
            "split": split}  # fmt: skip


def connections_by_router(server: servers.Running) -> list[int]:
    """How many of the client's connections each router holds (most first): the
    kernel spreads them over a fleet's routers (SO_REUSEPORT) by a hash."""
    port = server.address.rsplit(":", 1)[1]
    routers = {pid for pid, role in roles(server).items() if role == "router"}
    listing = subprocess.run(["ss", "-Htnp", "state", "established", f"( sport = :{port} )"],
                             capture_output=True, text=True, check=False).stdout  # fmt: skip
    counts: collections.Counter[int] = collections.Counter()
    for pid in re.findall(r"pid=(\d+)", listing):
        if int(pid) in routers:
            counts[int(pid)] += 1
    return sorted(counts.values(), reverse=True)


def _ours() -> float:
    """CPU of this script and its reaped children (perf_analyzer)."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def profile(subject: Subject, pa: install.PerfAnalyzer, window_ms: int, out: Path,
            concurrency: int, top: int, with_native: bool) -> None:  # fmt: skip
    server = subject.running
    assert server is not None
    folder = out / f"profile-{subject.label}"
    folder.mkdir(parents=True, exist_ok=True)
    spies: list[tuple[str, Path, subprocess.Popen[bytes]]] = []
    seconds = max(3, window_ms * 3 // 1000)
    native = ["--native"] if with_native else []
    for pid, role in sorted(roles(server).items()):
        if role == "supervisor":
            continue
        raw = folder / f"{role}-{pid}.txt"
        argv = [str(PY_SPY), "record", "--pid", str(pid), "--format", "raw", *native,
                "--rate", "200", "--duration", str(seconds), "--output", str(raw)]  # fmt: skip
        spies.append((role, raw, subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.DEVNULL)))  # fmt: skip
    time.sleep(0.5)  # let py-spy attach before the load starts
    perf.run(pa.binary, {**os.environ, **pa.env}, server.address, "echo", concurrency,
             window_ms, folder / "perf.csv", 300, LOAD.dims, LOAD.extra)  # fmt: skip
    for _, _, spy in spies:
        try:
            spy.wait(seconds + 30)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait()
    by_role: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    kinds: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: collections.Counter[str] = collections.Counter()
    for role, raw, _ in spies:
        if not raw.exists():
            print(f"  {role}: py-spy wrote nothing ({raw})")
            continue
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            if frames[-1].startswith(("process ", "thread ")) or _idle(frames):
                continue
            by_role[role][_short(frames[-1])] += int(count)
            kinds[role][_kind(frames[-1])] += int(count)
            for name in {_short(f) for f in frames if "(" in f and ".py" in f}:
                inclusive[role][name] += int(count)
            totals[role] += int(count)
    print(f"\n== py-spy, {subject.label}: top self-time functions per role "
          f"(share of that role's busy samples) ==")  # fmt: skip
    for role, counter in sorted(by_role.items()):
        print(f"-- {role} ({totals[role]} samples)")
        shares = ", ".join(
            f"{name} {100 * count / totals[role]:.0f}%" for name, count in kinds[role].most_common()
        )
        print(f"  by kind: {shares}")
        for name, count in counter.most_common(top):
            print(f"  {100 * count / totals[role]:5.1f}%  {name}")
        print(f"-- {role}: inclusive (Python functions on the stack)")
        for name, count in inclusive[role].most_common(top):
            print(f"  {100 * count / totals[role]:5.1f}%  {name}")


# A sample of a thread that waits (py-spy counts them unless it can tell idle threads
# apart, which it cannot on every host): the event loop's poll, a worker's blocking
# read, its heartbeat thread, the zygote; with --native, a leaf that is a wait.
WAITING = ("EpollSelector.select", "SocketIO.readinto", "heartbeat (", "_Zygote._serve")
NATIVE_WAITS = ("epoll_wait", "epoll_pwait", "poll", "ppoll", "clock_nanosleep", "select",
                "pselect6", "pthread_cond_wait", "pthread_cond_timedwait")  # fmt: skip
SYSCALLS = ("sendmsg", "recvmsg", "write", "writev", "read", "readv", "recv", "send", "syscall",
            "getpid", "epoll_ctl", "sendto", "recvfrom", "eventfd_write")  # fmt: skip


def _idle(frames: list[str]) -> bool:
    leaf = frames[-1].partition(" (")[0]
    if leaf in NATIVE_WAITS or frames[-1].startswith("Thread.run ("):
        return True  # (without --native a grpc thread shows only Thread.run: not ours)
    return any(mark in frame for frame in frames for mark in WAITING)


def _kind(frame: str) -> str:
    """What a leaf frame is: a system call, grpc's C core, asyncio, our code, ..."""
    name, _, where = frame.partition(" (")
    where = "/" + where  # py-spy shortens paths: "asyncio/events.py", "service/..."
    if name in SYSCALLS:
        return "system calls"
    if "cygrpc" in where or "libgrpc" in where:
        return "grpc C core"
    if "/asyncio/" in where or "_asynciomodule" in where:
        return "asyncio"
    if "/poolserve/" in where or "/service/" in where or "/supervisor/" in where:
        return "poolserve code"
    if "_message" in where or "upb" in name or "/protobuf/" in where:
        return "protobuf"
    if "numpy" in where or "_multiarray" in where:
        return "numpy"
    if ".py:" in where:
        return "other Python"
    return "CPython and libc"


def deterministic(subject: Subject, pa: install.PerfAnalyzer, window_ms: int, out: Path,
                  concurrency: int, top: int) -> None:  # fmt: skip
    """One more cell with cProfile on in the router and the pool server: the functions
    with the most own time, and how many calls each makes per request (exact counts;
    the times are inflated by the profiler, compare them with each other only)."""
    server = subject.running
    assert server is not None
    armed = {pid: role for pid, role in roles(server).items() if role in ("router", "pool")}
    for pid in armed:
        os.kill(pid, signal.SIGUSR1)
    got = cell(subject, pa, window_ms, out, concurrency)
    for pid in armed:
        os.kill(pid, signal.SIGUSR2)
    # the served count: what the worker-side CPU cell estimated (throughput x wall)
    requests = got["requests"]
    print(f"\n== cProfile, {subject.label}: {requests:.0f} requests (profiled, slower) ==")
    for pid, role in sorted(armed.items(), key=lambda item: item[1]):
        path = server.workdir / f"{role}-{pid}.prof"
        for _ in range(100):
            if path.exists() and path.stat().st_size:
                break
            time.sleep(0.1)
        stats = pstats.Stats(str(path))
        rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # type: ignore[attr-defined]
        total = sum(v[2] for _, v in rows)
        print(f"-- {role}: own time {1e6 * total / requests:.0f} us per request (profiled)")
        print("   share  calls/req  function")
        for (file, line, name), (_, ncalls, tottime, _, _) in rows[:top]:
            where = "/".join(file.rsplit("/", 2)[-2:])
            share, per = 100 * tottime / total, ncalls / requests
            print(f"  {share:5.1f}%  {per:8.2f}  {name} ({where}:{line})")


def syscalls(subject: Subject, pa: install.PerfAnalyzer, window_ms: int, out: Path,
             concurrency: int, top: int) -> None:  # fmt: skip
    """One more cell with ``strace -c -f`` on the router, the pool server and each
    worker: system calls per request by role (exact counts; strace slows the calls)."""
    server = subject.running
    assert server is not None
    folder = out / f"strace-{subject.label}"
    folder.mkdir(parents=True, exist_ok=True)
    traced = []
    for pid, role in sorted(roles(server).items()):
        if role in ("supervisor", "zygote"):
            continue
        path = folder / f"{role}-{pid}.txt"
        argv = ["strace", "-c", "-f", "-p", str(pid), "-o", str(path)]
        traced.append((role, path, subprocess.Popen(argv, stderr=subprocess.DEVNULL)))
    time.sleep(1.0)  # attached before the load starts
    got = cell(subject, pa, window_ms, out, concurrency)
    for _, _, tracer in traced:
        tracer.terminate()
        tracer.wait(30)
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for role, path, _ in traced:
        for line in path.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 5 and fields[0][0].isdigit() and fields[-1] != "total":
                counts[role][fields[-1]] += int(fields[3])
    served = counts["worker"]["recvfrom"] or got["requests"]  # a worker reads once per request
    print(f"\n== strace, {subject.label}: system calls per request ({served:.0f} requests) ==")
    for role, counter in sorted(counts.items()):
        total = sum(counter.values()) / served
        calls = ", ".join(f"{n} {c / served:.2f}" for n, c in counter.most_common(top))
        print(f"-- {role}: {total:.1f} per request: {calls}")


def _short(frame: str) -> str:
    """'fn (path/to/file.py:123)' -> 'fn (file.py)'."""
    name, _, where = frame.partition(" (")
    file = where.rsplit(":", 1)[0].rsplit("/", 2)
    return f"{name} ({'/'.join(file[-2:])})"


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument(
        "--tree", action="append", default=[], help="LABEL=DIR: a poolserve source folder"
    )
    parser.add_argument("--no-kserve", action="store_true")
    parser.add_argument("--inline", action="store_true", help="also the inline echo trees")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window-ms", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--profile", choices=["py-spy", "cprofile", "strace"], default=None)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--native", action="store_true", help="py-spy --native (C frames too)")
    parser.add_argument(
        "--routers2",
        action="store_true",
        help="also each tree with routers: 2 (the fleet's echo tree)",
    )
    parser.add_argument(
        "--large",
        action="store_true",
        help="the 9.2 MiB echo of bench/large_tensors.py instead of FP32 [1,16] (use -c 8)",
    )
    args = parser.parse_args()

    trees = [t.split("=", 1) for t in args.tree] or [["this", str(ROOT)]]
    subjects = [Subject(label, servers.spec("poolserve"), Path(src)) for label, src in trees]
    if args.routers2:
        subjects += [Subject(f"{label}-r2", servers.spec("poolserve-routers2"), Path(src))
                     for label, src in trees]  # fmt: skip
    if args.inline:
        subjects += [Subject(f"{label}-inline", servers.spec("poolserve-inline"), Path(src))
                     for label, src in trees]  # fmt: skip
    needed = [] if args.no_kserve else [install.PEER_VENVS["kserve"]()]
    installed = install.ensure_all(needed)
    if not args.no_kserve:
        subjects.append(Subject("kserve", servers.spec("kserve"), None))
    run_dir = WORK / f"profile-path-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.large:
        global LOAD
        shape = dict(large_tensors.SIZES)[large_tensors.LARGE]
        data = large_tensors.data_file(run_dir, large_tensors.LARGE, shape)
        LOAD = Load(large_tensors.DIMS, "INPUT0:" + ",".join(map(str, shape)),
                    ("--input-data", str(data)))  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {s.label: [] for s in subjects}
    try:
        for subject in subjects:
            subject.running = start(subject, run_dir, installed.venvs)
        for r in range(args.rounds):
            order = subjects if r % 2 == 0 else subjects[::-1]
            for subject in order:
                got = cell(subject, installed.perf_analyzer, args.window_ms, run_dir,
                           args.concurrency)  # fmt: skip
                results[subject.label].append(got)
                cpu = " ".join(f"{k} {v:.3f}" for k, v in sorted(got["cpu_ms"].items()))
                print(f"round {r + 1} {subject.label:>14}: {got['throughput']:8.1f}/s "
                      f"p99 {got['p99_ms']:6.1f} ms  other load {got['foreign_cores']:.2f} cores  "
                      f"cpu ms/req: {cpu}", flush=True)  # fmt: skip
                woke = " ".join(f"{k} {v:.1f}" for k, v in sorted(got["switches"].items()))
                split = "/".join(str(n) for n in got["split"]) or "?"
                print(f"{'':>24}context switches/req: {woke}  client connections per router: "
                      f"{split}", flush=True)  # fmt: skip
        report(results, args.rounds)
        for subject in subjects:
            if subject.source is None:
                continue
            if args.profile == "py-spy":
                profile(subject, installed.perf_analyzer, args.window_ms, run_dir,
                        args.concurrency, args.top, args.native)  # fmt: skip
            elif args.profile == "strace":
                syscalls(subject, installed.perf_analyzer, args.window_ms, run_dir,
                         args.concurrency, args.top)  # fmt: skip
            elif args.profile == "cprofile":
                deterministic(subject, installed.perf_analyzer, args.window_ms, run_dir,
                              args.concurrency, args.top)  # fmt: skip
    finally:
        for subject in subjects:
            if subject.running is not None:
                servers.stop(subject.running)


def report(results: dict[str, list[dict[str, Any]]], rounds: int) -> None:
    print("\n== medians over rounds (ratios: per round, then median) ==")
    kserve = results.get("kserve")
    for label, runs in results.items():
        tput = statistics.median(r["throughput"] for r in runs)
        roles_seen = sorted({k for r in runs for k in r["cpu_ms"]})
        cpu = " ".join(
            f"{k} {statistics.median(r['cpu_ms'].get(k, 0.0) for r in runs):.3f}"
            for k in roles_seen
        )
        line = f"{label:>14}: {tput:8.1f}/s  cpu ms/req: {cpu}"
        if kserve and label != "kserve":
            ratio = statistics.median(
                runs[i]["throughput"] / kserve[i]["throughput"] for i in range(rounds)
            )
            cpu_ratio = statistics.median(
                runs[i]["cpu_ms"]["total"] / kserve[i]["cpu_ms"]["total"] for i in range(rounds)
            )
            line += f"  | vs KServe: throughput {ratio:.2f}x, CPU/req {cpu_ratio:.2f}x"
        print(line)
    labels = [k for k in results if k != "kserve" and not k.endswith("-inline")]
    if len(labels) >= 2:
        first = results[labels[0]]
        for label in labels[1:]:
            runs = results[label]
            t = statistics.median(
                runs[i]["throughput"] / first[i]["throughput"] for i in range(rounds)
            )
            c = statistics.median(
                runs[i]["cpu_ms"]["total"] / first[i]["cpu_ms"]["total"] for i in range(rounds)
            )
            by_role = " ".join(
                f"{role} {_role_ratio(runs, first, role):.2f}x"
                for role in ("router", "pool", "worker")
            )
            print(f"{label} / {labels[0]}: throughput {t:.2f}x, CPU/req {c:.2f}x ({by_role})")


def _role_ratio(runs: list[dict[str, Any]], first: list[dict[str, Any]], role: str) -> float:
    """The median over rounds of one role's CPU per request, this tree's over the first's."""
    pairs = zip(runs, first, strict=True)
    return statistics.median(r["cpu_ms"].get(role, 0.0) / f["cpu_ms"][role] for r, f in pairs)


if __name__ == "__main__":
    main()
