"""Starts N processes of a script on this machine as one multi-process JAX job (CPU, gloo collectives).

Command::

    python -m jaxpar.cli.launch -n 2 experiments/charlm.py --steps 100 --out-dir runs/mh

Each process gets ``JAXPAR_COORDINATOR_ADDRESS`` (127.0.0.1 and a free port), ``JAXPAR_NUM_PROCESSES`` and
``JAXPAR_PROCESS_ID``, which :func:`jaxpar.initialize_distributed` reads, and its own simulated CPU devices
(``--xla_force_host_platform_device_count``, default: 8 split over the processes). This exercises the
multi-host code paths (process-local data, cross-process collectives, orbax's multi-process protocol) on one
machine. Process 0's output passes through; the others' lines are prefixed ``[process i]``.

Process control: SIGTERM / SIGINT to the launcher are forwarded to every process (as a cluster scheduler
does); if any process fails, the others are terminated; ``--timeout`` bounds the whole job. The exit status
is the first failing process's (a process killed by signal ``s`` counts as ``128 + s``), 124 on timeout,
else 0.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxpar.sharding.mesh import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(process_id: int, num_processes: int, port: int, devices_per_process: int,
                base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of process ``process_id``: coordinator variables, CPU platform, device count."""
    env = dict(os.environ if base is None else base)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}".strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    env[ENV_COORDINATOR] = f"127.0.0.1:{port}"
    env[ENV_NUM_PROCESSES] = str(num_processes)
    env[ENV_PROCESS_ID] = str(process_id)
    return env


def _forward(stream, prefix: str) -> None:
    for line in iter(stream.readline, b""):
        sys.stdout.buffer.write(prefix.encode() + line)
        sys.stdout.flush()
    stream.close()


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def launch(command: list[str], num_processes: int, devices_per_process: int | None = None,
           port: int | None = None, timeout: float | None = None, grace: float = 10.0) -> int:
    """Runs ``command`` (a Python script and its arguments) as ``num_processes`` cooperating processes.

    Args:
      command: ``[script.py, arg, ...]``, run with this Python interpreter.
      num_processes: how many processes (>= 1).
      devices_per_process: simulated CPU devices per process (default ``max(1, 8 // num_processes)``).
      port: the coordinator port (default: a free one).
      timeout: seconds before every process is killed (None: no limit).
      grace: seconds between SIGTERM and SIGKILL when stopping the processes.

    Returns:
      The job's exit status (see the module docstring).

    Raises:
      ValueError: ``num_processes`` < 1, an empty command.
    """
    if num_processes < 1:
        raise ValueError(f"-n {num_processes}: need at least one process")
    if not command:
        raise ValueError("no script given: python -m jaxpar.cli.launch -n 2 script.py [args ...]")
    per = devices_per_process or max(1, 8 // num_processes)
    port = port or free_port()
    procs: list[subprocess.Popen] = []
    threads = []
    for i in range(num_processes):
        pipe = subprocess.PIPE if i else None
        p = subprocess.Popen([sys.executable, *command], env=process_env(i, num_processes, port, per),
                             stdout=pipe, stderr=subprocess.STDOUT if i else None)
        procs.append(p)
        if i:
            t = threading.Thread(target=_forward, args=(p.stdout, f"[process {i}] "), daemon=True)
            t.start()
            threads.append(t)

    def forward_signal(signum, frame):
        del frame
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    previous = {s: signal.signal(s, forward_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def stop_all():
        for p in procs:
            if p.poll() is None:
                p.terminate()
        end = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    status, deadline = 0, None if timeout is None else time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed:
                status = _status(failed[0].returncode)
                print(f"[launch] process {procs.index(failed[0])} exited with {status}; stopping the others",
                      file=sys.stderr, flush=True)
                stop_all()
                break
            if deadline is not None and time.monotonic() > deadline:
                print(f"[launch] timeout after {timeout} s; killing every process", file=sys.stderr, flush=True)
                stop_all()
                status = 124
                break
            time.sleep(0.05)
        if status == 0:
            status = next((_status(p.returncode) for p in procs if p.returncode), 0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for s, h in previous.items():
            signal.signal(s, h)
        for t in threads:
            t.join(timeout=5)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxpar.cli.launch", description=__doc__.split("\n")[0])
    parser.add_argument("-n", "--num-processes", type=int, default=2, help="processes to start (default 2)")
    parser.add_argument("--devices-per-process", type=int, default=None,
                        help="simulated CPU devices per process (default: 8 split over the processes)")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before every process is killed")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="script.py [args ...]")
    args = parser.parse_args(argv)
    try:
        return launch(args.command, args.num_processes, args.devices_per_process, args.port, args.timeout)
    except ValueError as e:
        parser.error(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["launch", "main"]
