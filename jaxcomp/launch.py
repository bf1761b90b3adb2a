"""Starts an N-process JAX job on one machine, for trying multi-host code::

  jaxcomp launch -n 2 --devices-per-process 2 -- \\
      python examples/multihost/train_mlp.py --steps 20

Every child gets ``JAXCOMP_COORDINATOR_ADDRESS`` (127.0.0.1 and a free port),
``JAXCOMP_NUM_PROCESSES`` and ``JAXCOMP_PROCESS_ID``, which
:func:`jaxcomp.distributed.initialize_from_env` reads. Output lines are
prefixed with ``[p<i>]``.

The job is torn down as a whole: when one process exits with an error or is
killed, the launcher reports which one and its exit code, gives the others
``--grace`` seconds to stop on their own (by default the heartbeat timeout
plus 5 s: jaxcomp's peer watcher makes each survivor exit with status 75
and a line naming the lost process, see
:func:`jaxcomp.distributed.watching_peers`), then terminates them (SIGTERM,
and SIGKILL after 5 s), and exits non-zero. The processes also die when the launcher
itself dies, SIGKILL included (Linux ``PR_SET_PDEATHSIG``). Exit status: 0
when every process exited 0; the failing process's code (128 + signal number
if it was killed by a signal); 124 on ``--timeout``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from jaxcomp import distributed

_KILL_AFTER_S = 5.0


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that is free now (bind to port 0 and read it back).

  Another program may take it before the coordinator binds it; the window is
  short, and each call returns a different port where several jobs start at
  once.
  """
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


@dataclasses.dataclass
class JobResult:
  """What :func:`launch` observed.

  Attributes:
    returncode: the job's exit status (see the module docstring).
    returncodes: each process's exit code (negative: killed by that signal;
      None: still running when the launcher gave up, then killed).
    failed: index of the first process that failed, or None.
    exit_times: seconds from the start to each process's exit (as seen by
      the launcher, which polls every 50 ms).
    terminated: indices of the processes the launcher had to terminate
      (SIGTERM/SIGKILL) rather than seeing them exit by themselves.
    seconds: wall time from start to the last process's exit.
    message: a one-line summary.
  """

  returncode: int
  returncodes: list[int | None]
  failed: int | None
  exit_times: list[float]
  terminated: list[int]
  seconds: float
  message: str


def check_port(port: int, host: str = "127.0.0.1") -> None:
  """Raises ValueError unless ``port`` is a TCP port number that is free on
  ``host`` now (process 0's coordinator must bind it)."""
  if isinstance(port, bool) or not isinstance(port, int) or not (
      1 <= port <= 65535):
    raise ValueError(f"port must be in 1..65535, got {port=!r}")
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    try:
      s.bind((host, port))
    except OSError as e:
      raise ValueError(
          f"port {port} on {host} is in use ({e.strerror}); pick another "
          "or omit --port for a free one") from None


def _describe_code(code: int) -> str:
  if code < 0:
    try:
      return f"killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"killed by signal {-code}"
  if code == distributed.PEER_LOST_EXIT_CODE:
    return f"exit code {code} (it lost a peer)"
  return f"exit code {code}"


def _exit_status(code: int) -> int:
  return 128 - code if code < 0 else code


def _pump(stream, prefix: str, out) -> None:
  for line in iter(stream.readline, b""):
    try:
      out.write(prefix + line.decode(errors="replace"))
      out.flush()
    except (ValueError, OSError):  # the output was closed
      break
  stream.close()


# Each process starts as this small Python program, which asks the kernel to
# SIGKILL it when the launcher dies (Linux PR_SET_PDEATHSIG; kept across
# exec), makes sure the launcher had not already died, and then execs the
# command, which keeps its pid, environment and output pipe. Doing this in a
# fresh process rather than in a ``preexec_fn`` keeps Python code out of the
# window between fork and exec, which is not safe in a launcher with threads
# (JAX's, or an earlier job's output threads).
DIE_WITH_PARENT = """\
import ctypes, os, signal, sys
try:
  ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
except (OSError, AttributeError):
  pass
if os.getppid() != int(sys.argv[1]):
  os.kill(os.getpid(), signal.SIGKILL)
try:
  os.execv(sys.argv[2], sys.argv[3:])
except OSError as e:
  sys.exit(f"jaxcomp.launch: cannot run {sys.argv[3]!r}: {e}")
"""


def _resolve(program: str, path: str | None) -> str:
  """``program`` as execvp would find it, or a FileNotFoundError now."""
  found = shutil.which(program, path=path)
  if found is None:
    raise FileNotFoundError(
        f"command[0] = {program!r} is not an executable file"
        + ("" if os.sep in program else " on PATH")
        + "; give its full path or fix PATH")
  return found


def launch(command: Sequence[str], num_processes: int, *,
           devices_per_process: int | None = None,
           port: int | None = None,
           grace: float | None = None,
           timeout: float | None = None,
           heartbeat_timeout: int | None = None,
           preemption_grace: float = 60.0,
           env: dict[str, str] | None = None,
           stdout=None) -> JobResult:
  """Runs ``command`` as ``num_processes`` processes of one JAX job.

  Args:
    command: the program and its arguments, e.g. ``["python", "train.py"]``.
    num_processes: how many processes (>= 1).
    devices_per_process: simulate this many CPU devices in each process
      (sets ``JAX_PLATFORMS=cpu`` and ``XLA_FLAGS=
      --xla_force_host_platform_device_count=D``); None leaves the platform
      alone (on a GPU host, give each process its GPUs yourself, e.g. with
      ``CUDA_VISIBLE_DEVICES``).
    port: coordinator port on 127.0.0.1; default a free one.
    grace: seconds the other processes get to stop on their own after one
      fails, before they are terminated. Default: the heartbeat timeout
      plus 5 s, time for jaxcomp's peer watcher to stop each of them with a
      line naming the lost process (0 terminates them at once).
    timeout: seconds for the whole job; then every process is killed and
      the status is 124.
    heartbeat_timeout: seconds after which JAX declares a silent process
      dead (``JAXCOMP_HEARTBEAT_TIMEOUT``); default
      :func:`jaxcomp.distributed.initialize_from_env`'s.
    preemption_grace: when the launcher gets SIGTERM (a scheduler's
      preemption), it forwards SIGTERM to every process and gives them this
      many seconds to checkpoint and exit (see
      :func:`jaxcomp.distributed.preemption_requested`) before SIGKILL; if
      they all exit 0 the job's status is 0. SIGINT stops the job at once.
    env: extra environment variables for every process.
    stdout: where the prefixed output goes (default ``sys.stdout``).

  Returns:
    A :class:`JobResult`.

  Raises:
    ValueError: an empty command or a bad count or time.
    FileNotFoundError: ``command[0]`` is not an executable file (on the
      ``PATH`` the processes get); raised before any process starts.
  """
  _check_launch_args(command, num_processes,
                     devices_per_process=devices_per_process, port=port,
                     grace=grace, timeout=timeout,
                     heartbeat_timeout=heartbeat_timeout)
  out = stdout or sys.stdout
  base = _job_environment(env, port or free_port(), num_processes,
                          heartbeat_timeout=heartbeat_timeout,
                          devices_per_process=devices_per_process)
  if grace is None:  # the survivors' watchers stop them within a heartbeat
    grace = _default_grace(base)
  argv, executable = _child_command(command, base)
  job = _start(argv, executable, base, num_processes, out)
  interrupted: list[int] = []
  old_handlers = _catch_signals(interrupted)
  try:
    _watch(job, grace=grace, timeout=timeout,
           preemption_grace=preemption_grace, interrupted=interrupted)
  finally:
    for sig, h in old_handlers.items():
      signal.signal(sig, h)
    _reap(job)
  return _result(job, num_processes)


def _check_launch_args(command: Sequence[str], num_processes: int, *,
                       devices_per_process: int | None, port: int | None,
                       grace: float | None, timeout: float | None,
                       heartbeat_timeout: int | None) -> None:
  """Raises ValueError for an empty command, a bad count or time, or a busy port."""
  if not command:
    raise ValueError("command is empty; put it after '--', e.g. "
                     "jaxcomp launch -n 2 -- python train.py")
  if num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes=}")
  if devices_per_process is not None and devices_per_process < 1:
    raise ValueError(
        f"devices_per_process must be >= 1, got {devices_per_process=}")
  if heartbeat_timeout is not None and heartbeat_timeout < 1:
    raise ValueError(f"heartbeat_timeout must be >= 1 second, got "
                     f"{heartbeat_timeout=} (omit it for JAX's default)")
  if (grace is not None and grace < 0) or (timeout is not None
                                           and timeout <= 0):
    raise ValueError(f"need grace >= 0 and timeout > 0, got {grace=}, "
                     f"{timeout=}")
  if port is not None:
    check_port(port)


def _job_environment(env: dict[str, str] | None, port: int, num_processes: int,
                     *, heartbeat_timeout: int | None,
                     devices_per_process: int | None) -> dict[str, str]:
  """The environment every process shares (all but its process id)."""
  base = dict(os.environ)
  base.update(env or {})
  base[distributed.ENV_COORDINATOR] = f"127.0.0.1:{port}"
  base[distributed.ENV_NUM_PROCESSES] = str(num_processes)
  if heartbeat_timeout is not None:
    base[distributed.ENV_HEARTBEAT] = str(int(heartbeat_timeout))
  if devices_per_process is not None:
    base["JAX_PLATFORMS"] = "cpu"
    flags = [f for f in base.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
    base["XLA_FLAGS"] = " ".join(flags)
  base["PYTHONUNBUFFERED"] = "1"
  return base


def _default_grace(base: dict[str, str]) -> float:
  """The processes' heartbeat timeout (from ``base``) plus the kill delay, seconds."""
  try:
    heartbeat = int(base.get(distributed.ENV_HEARTBEAT) or
                    distributed.DEFAULT_HEARTBEAT_TIMEOUT)
  except ValueError:
    heartbeat = distributed.DEFAULT_HEARTBEAT_TIMEOUT
  return float(heartbeat + _KILL_AFTER_S)


def _child_command(command: Sequence[str],
                   base: dict[str, str]) -> tuple[list[str], str]:
  """(argv, executable) that runs ``command`` under :data:`DIE_WITH_PARENT`."""
  program = _resolve(command[0], base.get("PATH"))
  if sys.executable:
    argv = [sys.executable, "-I", "-S", "-c", DIE_WITH_PARENT,
            str(os.getpid()), program, *command]
    return argv, sys.executable
  # An embedded interpreter has no python to run the stub with.
  return list(command), program


@dataclasses.dataclass
class _Job:
  """A running job, as the launcher's polling loop updates it.

  Attributes:
    procs: the processes, by process id.
    pumps: the threads that copy their output.
    t0: when the first process started (``time.monotonic``).
    failed: index of the first process that failed, or None.
    status: the job's exit status so far.
    deadline_kill: when to start terminating the processes still running.
    terminated_at: when the launcher sent them SIGTERM.
    message: the one-line summary so far.
    exit_times: seconds from ``t0`` to each process's exit (None: running).
    terminated: indices of the processes the launcher terminated.
  """

  procs: list[subprocess.Popen]
  pumps: list[threading.Thread]
  t0: float
  failed: int | None = None
  status: int = 0
  deadline_kill: float | None = None
  terminated_at: float | None = None
  message: str = ""
  exit_times: list[float | None] = dataclasses.field(default_factory=list)
  terminated: list[int] = dataclasses.field(default_factory=list)


def _start(argv: list[str], executable: str, base: dict[str, str],
           num_processes: int, out) -> _Job:
  """Starts the processes, each with its process id, and their output threads."""
  t0 = time.monotonic()
  procs, pumps = [], []
  for i in range(num_processes):
    child_env = dict(base)
    child_env[distributed.ENV_PROCESS_ID] = str(i)
    p = subprocess.Popen(argv, executable=executable, env=child_env,
                         stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, start_new_session=True)
    procs.append(p)
    t = threading.Thread(target=_pump, args=(p.stdout, f"[p{i}] ", out),
                         daemon=True)
    t.start()
    pumps.append(t)
  return _Job(procs, pumps, t0, exit_times=[None] * num_processes)


def _say(msg: str) -> None:
  """Prints a line of the launcher's own on stderr."""
  print(f"jaxcomp.launch: {msg}", file=sys.stderr, flush=True)


def _signal_all(sig: int, which) -> None:
  """Sends ``sig`` to the process group of each of ``which`` still running."""
  for p in which:
    if p.poll() is None:
      try:
        os.killpg(p.pid, sig)
      except ProcessLookupError:
        pass


def _catch_signals(interrupted: list[int]) -> dict:
  """Appends SIGINT and SIGTERM to ``interrupted`` (main thread only); returns the old handlers."""
  old_handlers = {}
  if threading.current_thread() is threading.main_thread():
    for sig in (signal.SIGINT, signal.SIGTERM):
      old_handlers[sig] = signal.signal(
          sig, lambda s, f: interrupted.append(s))
  return old_handlers


def _watch(job: _Job, *, grace: float, timeout: float | None,
           preemption_grace: float, interrupted: list[int]) -> None:
  """Polls the processes every 50 ms until all have exited, stopping the job
  when one fails, on a signal or past ``timeout``."""
  while True:
    codes = [p.poll() for p in job.procs]
    now = time.monotonic()
    for i, c in enumerate(codes):
      if c is not None and job.exit_times[i] is None:
        job.exit_times[i] = now - job.t0
    if job.failed is None and job.deadline_kill is None:
      _note_failure(job, codes, now, grace)
    if all(c is not None for c in codes):
      break
    if interrupted and job.deadline_kill is None:
      _note_signal(job, interrupted[0], now, preemption_grace)
    if (timeout is not None and now - job.t0 > timeout
        and job.deadline_kill is None):
      _say(f"the job ran past --timeout {timeout:g} s; stopping it")
      job.status, job.message = 124, f"timed out after {timeout:g} s"
      job.deadline_kill = now
    _stop_when_due(job, now)
    time.sleep(0.05)


def _note_failure(job: _Job, codes: list[int | None], now: float,
                  grace: float) -> None:
  """Records the first process that exited non-zero, giving the others ``grace`` s."""
  for i, c in enumerate(codes):
    if c not in (None, 0):
      job.failed, job.status = i, _exit_status(c)
      alive = sum(c2 is None for c2 in codes)
      job.message = (f"process {i} (pid {job.procs[i].pid}) failed with "
                     f"{_describe_code(c)}")
      _say(f"{job.message}; stopping the other {alive} process(es)"
           + (f" (after up to {grace:g} s)" if grace and alive else ""))
      job.deadline_kill = now + grace
      return


def _note_signal(job: _Job, sig: int, now: float,
                 preemption_grace: float) -> None:
  """SIGTERM: forwards it, giving ``preemption_grace`` s; SIGINT: stops the job now."""
  if sig == signal.SIGTERM:
    _say(f"SIGTERM: forwarding it (preemption); the processes have "
         f"{preemption_grace:g} s to checkpoint and exit")
    _signal_all(signal.SIGTERM, job.procs)
    job.status, job.message = 128 + sig, "preempted"
    job.deadline_kill = now + preemption_grace
  else:
    _say(f"interrupted by {signal.Signals(sig).name}; stopping the job")
    job.status, job.message = 128 + sig, "interrupted"
    job.deadline_kill = now


def _stop_when_due(job: _Job, now: float) -> None:
  """Past the deadline, SIGTERM to the processes still running, SIGKILL 5 s later."""
  if job.deadline_kill is not None and now >= job.deadline_kill:
    if job.terminated_at is None:
      job.terminated.extend(i for i, p in enumerate(job.procs) if p.poll() is None)
      _signal_all(signal.SIGTERM, job.procs)
      job.terminated_at = now
    elif now - job.terminated_at > _KILL_AFTER_S:
      _signal_all(signal.SIGKILL, job.procs)


def _reap(job: _Job) -> None:
  """Kills what still runs, waits for every process and joins the output threads."""
  _signal_all(signal.SIGKILL, [p for p in job.procs if p.poll() is None])
  for p in job.procs:
    p.wait()
  for t in job.pumps:
    t.join(timeout=5)


def _result(job: _Job, num_processes: int) -> JobResult:
  """The :class:`JobResult` of a finished job, its summary said on stderr."""
  seconds = time.monotonic() - job.t0
  codes = [p.returncode for p in job.procs]
  ends = [seconds if t is None else t for t in job.exit_times]
  status, message, failed = job.status, job.message, job.failed
  if failed is not None:
    others = ", ".join(
        f"process {i}: {_describe_code(c)}"
        + (" (terminated by the launcher)" if i in job.terminated else "")
        + f" at {ends[i] - ends[failed]:+.1f} s"
        for i, c in enumerate(codes) if i != failed)
    message += f"; {others}" if others else ""
    _say(f"job failed in {seconds:.1f} s: {message}")
  elif message == "preempted" and all(c == 0 for c in codes):
    status = 0
    message = (f"preempted: all {num_processes} processes exited 0 in "
               f"{seconds:.1f} s")
    _say(message)
  elif status == 0:
    message = f"all {num_processes} processes exited 0 in {seconds:.1f} s"
  return JobResult(status, codes, failed, ends, job.terminated, seconds,
                   message)

def add_launch_command(subparsers) -> None:
  """Adds ``launch`` (``jaxcomp launch -n N [options] -- command ...``) to
  the ``jaxcomp`` command line's ``subparsers``; its ``func(args)`` runs
  :func:`launch` and returns the job's exit status (see the module
  docstring). A bad argument raises ValueError, a missing program
  FileNotFoundError (the command line reports either with exit status 2)."""
  p = subparsers.add_parser(
      "launch", help="start an N-process JAX job on this machine, for trying "
      "multi-host code", description=__doc__,
      usage="%(prog)s -n N [options] -- command [args ...]",
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("-n", "--num-processes", type=int, required=True)
  p.add_argument("--devices-per-process", type=int, default=None,
                 help="simulated CPU devices per process (sets "
                 "JAX_PLATFORMS=cpu); omit on GPU hosts")
  p.add_argument("--port", type=int, default=None,
                 help="coordinator port (default: a free one)")
  p.add_argument("--grace", type=float, default=None,
                 help="seconds the others get to stop by themselves after "
                 "one process fails (default: the heartbeat timeout + 5 s, "
                 "so that each says which process it lost; 0: at once)")
  p.add_argument("--timeout", type=float, default=None,
                 help="seconds for the whole job (exit status 124)")
  p.add_argument("--heartbeat-timeout", type=int, default=None,
                 help="seconds of silence before JAX declares a process dead")
  p.add_argument("--preemption-grace", type=float, default=60.0,
                 help="after SIGTERM, seconds the processes get to checkpoint "
                 "and exit before SIGKILL (default 60)")
  p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="command",
                 help="after '--': the program every process runs, and its "
                 "arguments")
  p.set_defaults(func=_run_launch)


def _run_launch(args: argparse.Namespace) -> int:
  """``jaxcomp launch``: the job's exit status."""
  command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
  if not command:
    raise ValueError("no command: put it after '--', e.g. jaxcomp launch "
                     "-n 2 -- python examples/multihost/train_mlp.py")
  result = launch(command, args.num_processes,
                  devices_per_process=args.devices_per_process,
                  port=args.port, grace=args.grace, timeout=args.timeout,
                  heartbeat_timeout=args.heartbeat_timeout,
                  preemption_grace=args.preemption_grace)
  return result.returncode


if __name__ == "__main__":  # a library module: its command is on the CLI
  sys.exit("jaxcomp.launch is not a command: run `jaxcomp launch -n N -- command ...` "
           "(or `python -m jaxcomp launch ...`)")
