"""``poolserve supervisord-config REPO``: a flat supervisord configuration.

For teams that want supervisord to own every process: one
``[program:poolserve-pool-<gid>]`` per inference pool (``poolserve pool``)
and one ``[program:poolserve-router]`` (``poolserve router``), instead of the
single ``poolserve serve`` program of ``deploy/supervisord/poolserve.conf``.

What ``poolserve serve`` does for its tree, the generated sections ask of
supervisord:

- order: pools get a lower ``priority`` than the router, so supervisord
  starts them first and, stopping everything, stops the router first (it
  drains) and the pools after it;
- signals: SIGTERM goes to the pool server alone (``stopasgroup=false``):
  it drains its in-flight calls, then stops its zygote and workers itself.
  Sent to the whole group, it would kill the workers under the calls they
  hold and make the pool exit 1 ("zygote died"). SIGKILL, when the drain
  overruns ``stopwaitsecs``, goes to the whole group (``killasgroup``); and
  the zygote and workers die with the pool server anyway (PR_SET_PDEATHSIG).
  The router has no children: its group is itself;
- bounds: ``stopwaitsecs`` above ``stop_grace_s`` (the drain), ``startsecs``
  and ``autorestart=unexpected`` with the exit codes that must not loop
  (2: invalid configuration; for a pool also 3: it cannot work, e.g. another
  live process serves its socket);
- one run directory, resolved now and passed to every program, so that the
  router finds the pools' sockets whatever environment supervisord has.

The router does not wait for the pools: it follows their health and answers
NOT_SERVING until every pool is up, which is what readiness checks watch.
"""

from __future__ import annotations

import math
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from poolserve.service.contract.repository import scan
from poolserve.service.contract.settings import (
    ConfigError,
    ServerSettings,
    load_server_settings,
    router_count,
)
from poolserve.service.lifecycle.cpus import usable_cores
from poolserve.service.lifecycle.exitcodes import EXIT_CONFIG, EXIT_OK, EXIT_UNRECOVERABLE

POOL_PRIORITY = 100
ROUTER_PRIORITY = 200
START_SECS = 3
START_RETRIES = 3
# supervisord's SIGKILL comes this long after the process's own drain bound.
STOP_MARGIN_S = 5
PROGRAM_PREFIX = "poolserve"

# The flags of `poolserve pool` / `poolserve router`, in command-line order.
_FLAG_NAMES = (
    ("host", "--host"),
    ("grpc_port", "--grpc-port"),
    ("metrics_port", "--metrics-port"),
    ("http_port", "--http-port"),
    ("parallel_workers", "--workers"),
    ("log_format", "--log-format"),
)


@dataclass(frozen=True)
class Program:
    """One ``[program:x]`` section: its name and its options, in order."""

    name: str
    options: tuple[tuple[str, str], ...]

    def render(self) -> str:
        lines = [f"[program:{self.name}]"]
        lines += [f"{key}={value}" for key, value in self.options]
        return "\n".join(lines) + "\n"


def pool_program_name(gid: str) -> str:
    return f"{PROGRAM_PREFIX}-pool-{gid}"


ROUTER_PROGRAM = f"{PROGRAM_PREFIX}-router"


def default_executable() -> list[str]:
    """The ``poolserve`` console script beside this interpreter, else ``python -m``."""
    beside = Path(sys.executable).parent / "poolserve"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("poolserve")
    if found:
        return [found]
    return [sys.executable, "-m", "poolserve.supervisor.cli"]


def _quote(argv: Sequence[str]) -> str:
    # supervisord splits `command` with shlex and expands %(name)s: escape both.
    return " ".join(shlex.quote(arg) for arg in argv).replace("%", "%%")


def _common_options(
    settings: ServerSettings,
    *,
    priority: int,
    stop_as_group: bool,
    user: str | None,
    log_stdout: bool,
    final_codes: Sequence[int] = (EXIT_OK, EXIT_CONFIG),
) -> list[tuple[str, str]]:
    stopwait = math.ceil(settings.stop_grace_s) + STOP_MARGIN_S
    options = [
        ("priority", str(priority)),
        ("autostart", "true"),
        ("autorestart", "unexpected"),
        ("exitcodes", ",".join(str(code) for code in final_codes)),
        ("startsecs", str(START_SECS)),
        ("startretries", str(START_RETRIES)),
        ("stopsignal", "TERM"),
        ("stopwaitsecs", str(stopwait)),
        ("stopasgroup", "true" if stop_as_group else "false"),
        ("killasgroup", "true"),
        ("redirect_stderr", "true"),
    ]
    if user:
        options.append(("user", user))
    if log_stdout:
        options += [("stdout_logfile", "/dev/fd/1"), ("stdout_logfile_maxbytes", "0")]
    return options


def build_programs(
    repo: Path,
    flags: Mapping[str, object],
    *,
    executable: Sequence[str] | None = None,
    user: str | None = None,
    log_stdout: bool = False,
) -> list[Program]:
    """The pools' programs (sorted by gid), then the router's.

    Raises ConfigError for a repository without any valid model.
    """
    repo = repo.resolve()
    settings = load_server_settings(repo, flags=flags)
    pools = scan(repo).pools()
    if not pools:
        raise ConfigError(str(repo), "(repository)", "no valid model, so no pool to run")
    run_dir = Path(settings.resolved_run_dir()).absolute()
    exe = list(executable) if executable else default_executable()
    shared: list[str] = []
    for key, flag in _FLAG_NAMES:
        value = flags.get(key)
        if value is not None:
            shared += [flag, str(value)]
    shared += ["--run-dir", str(run_dir)]

    programs = []
    for gid in pools:
        argv = [*exe, "pool", str(repo), "--gid", gid, *shared]
        options = [("command", _quote(argv))]
        options += _common_options(
            settings,
            priority=POOL_PRIORITY,
            stop_as_group=False,
            user=user,
            log_stdout=log_stdout,
            final_codes=(EXIT_OK, EXIT_CONFIG, EXIT_UNRECOVERABLE),
        )
        programs.append(Program(pool_program_name(gid), tuple(options)))
    # One router: a fleet (routers > 1) needs the ports `poolserve serve` holds for it.
    router = [("command", _quote([*exe, "router", str(repo), *shared, "--routers", "1"]))]
    router += _common_options(
        settings, priority=ROUTER_PRIORITY, stop_as_group=True, user=user, log_stdout=log_stdout
    )
    programs.append(Program(ROUTER_PROGRAM, tuple(router)))
    return programs


def render_config(repo: Path, programs: Sequence[Program]) -> str:
    names = ", ".join(p.name for p in programs)
    header = (
        f"; poolserve: flat supervisord configuration for {repo.resolve()}\n"
        "; generated by `poolserve supervisord-config`; regenerate it when pools change.\n"
        f"; programs: {names}\n"
        "; Pools start before the router (priority); supervisord's shutdown stops the\n"
        "; router first (it drains), then the pools. `supervisorctl stop all` stops\n"
        "; every program at once: each drains its own in-flight calls.\n"
        "; settings.json and POOLSERVE_* in supervisord's environment apply to each program.\n"
    )
    return header + "".join("\n" + p.render() for p in programs)


def standalone_sections(directory: Path) -> str:
    """The sections that make the programs a whole supervisord.conf, every
    path under ``directory``: supervisord itself (in the foreground, so a
    terminal, systemd or a container can own it), its private control socket,
    and what ``supervisorctl`` needs to reach it."""
    root = directory.resolve()
    return (
        f"; run it: supervisord -c THIS_FILE; then supervisorctl -c THIS_FILE status\n"
        f"[unix_http_server]\nfile={root}/supervisord.sock\nchmod=0700\n\n"
        f"[supervisord]\nlogfile={root}/supervisord.log\npidfile={root}/supervisord.pid\n"
        f"childlogdir={root}\nnodaemon=true\n\n"
        "[rpcinterface:supervisor]\n"
        "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface\n\n"
        f"[supervisorctl]\nserverurl=unix://{root}/supervisord.sock\n\n"
    )


def main(
    repo: Path,
    flags: Mapping[str, object],
    *,
    executable: Sequence[str] | None = None,
    user: str | None = None,
    log_stdout: bool = False,
    standalone: Path | None = None,
) -> int:
    """Prints the configuration; exit code 2 for an invalid configuration.

    With ``standalone``, a complete supervisord.conf (see
    :func:`standalone_sections`); without, only the program sections, for an
    ``[include]`` in an existing supervisord.conf."""
    try:
        programs = build_programs(
            repo, flags, executable=executable, user=user, log_stdout=log_stdout
        )
    except ConfigError as exc:
        print(f"poolserve supervisord-config: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    asked = router_count(load_server_settings(repo.resolve(), flags=flags), usable_cores())
    if asked > 1:  # said, not silently dropped: the program runs one router
        print(
            f"poolserve supervisord-config: routers {asked}: this layout runs one router"
            " (a fleet shares ports that only `poolserve serve` holds for it);"
            " use `poolserve serve` under supervisord (one program) for a fleet",
            file=sys.stderr,
        )
    sections = standalone_sections(standalone) if standalone is not None else ""
    sys.stdout.write(sections + render_config(repo, programs))
    return EXIT_OK
