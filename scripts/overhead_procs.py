"""``bench_overhead.py``'s view of processes: pinning, CPU time from /proc (per process and per thread),
what the rest of the machine is doing, and starting the paths under test (nginx, specproxy).

CPU is read where the kernel keeps it: utime+stime from /proc/PID/stat (in clock ticks) and on-CPU
nanoseconds from /proc/PID/task/*/schedstat, so that the benchmark needs nothing inside the proxy.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from overhead_peers import now_ns, raise_nofile

CLK_TCK = os.sysconf("SC_CLK_TCK")

def pin(cores: set[int] | None):
    def fn() -> None:
        raise_nofile()
        if cores:
            os.sched_setaffinity(0, cores)

    return fn


def proc_cpu_s(pid: int) -> float:
    """utime + stime of the whole process (all threads), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of proc(5)


def procs_cpu_s(pids) -> dict[int, float]:
    """utime + stime of each of ``pids`` still running (a PostgreSQL backend or autovacuum worker may
    end between two readings): sum the differences over the pids both readings have."""
    out = {}
    for pid in pids:
        try:
            out[pid] = proc_cpu_s(pid)
        except (OSError, ValueError, IndexError):
            pass
    return out


def cpu_between(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the processes read in both ``procs_cpu_s`` readings used between them."""
    return sum(after[p] - before[p] for p in after if p in before)


def proc_sched_s(pid: int) -> float:
    """On-CPU time of all the process's threads in ns precision (/proc/PID/task/*/schedstat)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


def wake_floor(cpu_a: int, cpu_b: int, period_s: float = 0.01, n: int = 200) -> tuple[float, float, float]:
    """This machine's cross-CPU wake-up latency: a pipe write on one CPU every ``period_s`` (the reader on
    the other CPU idles in between, as a proxy does between decode steps); p50, p99, max in µs."""
    import struct

    r, w = os.pipe()
    res_r, res_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the reader
        try:
            os.sched_setaffinity(0, {cpu_b})
            lats = []
            for _ in range(n):
                d = os.read(r, 8)
                lats.append(now_ns() - struct.unpack("q", d)[0])
            lats.sort()
            os.write(res_w, json.dumps([lats[n // 2] / 1e3, lats[int(n * 0.99)] / 1e3, lats[-1] / 1e3]).encode())
        finally:
            os._exit(0)
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu_a})
    try:
        for _ in range(n):
            time.sleep(period_s)
            os.write(w, struct.pack("q", now_ns()))
        os.waitpid(pid, 0)
        out = json.loads(os.read(res_r, 4096))
    finally:
        os.sched_setaffinity(0, mask)
        for fd in (r, w, res_r, res_w):
            os.close(fd)
    return tuple(out)


def threads_cpu(pid: int) -> dict[int, tuple[float, float, float]]:
    """utime, stime and on-CPU time (seconds) of each thread of a process. utime and stime are counted in
    clock ticks (10 ms), charged to whichever thread a tick finds running, so a thread that ran 5 ms in a
    short window may show none; the on-CPU time (``schedstat``, ns) says whether it ran at all."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                on_cpu = int(f.read().split()[0]) / 1e9
            out[int(tid)] = (int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK, on_cpu)
        except (OSError, ValueError, IndexError):
            pass
    return out


# specproxy's threads name their OS threads (``specproxy.wire.os_thread``, the relay in ``_pump.c``); Linux
# keeps 15 bytes of a name, so a ``comm`` is matched back to the full name it was cut from.
SPECPROXY_THREADS = ("specproxy-measure", "specproxy-writer", "specproxy-cadence", "specproxy-relay",
                     "specproxy-ship", "specproxy-otlp")


def thread_names(pid: int) -> dict[int, str]:
    """Thread names by OS thread id: the main thread (its id is the process's) as ``MainThread``,
    specproxy's own by their OS names, Python's from ``py-spy dump`` when py-spy is installed, and any
    other thread by its OS name (``/proc/PID/task/TID/comm``: the process's, for a thread nobody named)."""
    names = {pid: "MainThread"}
    for tid in listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if int(tid) != pid:
            names[int(tid)] = next((n for n in SPECPROXY_THREADS if n[:15] == comm), f"{comm} (unnamed)"
                                   if not comm.startswith("specproxy") else comm)
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.path.exists(spy):
        return names
    try:
        out = subprocess.run([spy, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return names
    for line in out.splitlines():
        if line.startswith("Thread "):
            parts = line.split()
            try:
                tid = int(parts[1], 0)
            except ValueError:
                continue
            names[tid] = line.split('"')[1] if '"' in line else parts[1]
    return names


def machine_busy_s() -> float:
    """CPU seconds all CPUs spent not idle (user+nice+system+irq+softirq+steal), from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / CLK_TCK


def listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def children(pid: int) -> list[int]:
    """Child processes of every thread of ``pid`` (a child started from a worker thread is listed under
    that thread, not under the main one)."""
    out: list[int] = []
    for tid in listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:
            pass
    return out


def hwm_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port} after {timeout} s")


def stop(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def ensure_nginx() -> str | None:
    """The nginx binary; installed from Debian (nginx-light, else nginx) when missing."""
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        print("nginx is missing and cannot be installed here (needs root and apt-get): skipping nginx", file=sys.stderr)
        return None
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    print("installing nginx from Debian (apt-get install -y nginx-light)...", file=sys.stderr)
    for attempt in range(2):
        for pkg in ("nginx-light", "nginx"):
            r = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", pkg], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
            if r.returncode == 0:
                break
        else:
            if attempt == 0:
                subprocess.run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=600)
                continue
        break
    return shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)


NGINX_CONF = """\
worker_processes 1;
worker_rlimit_nofile 65536;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 16384; multi_accept on; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    client_max_body_size 64m;
    client_body_buffer_size 1m;
    upstream up {{ server 127.0.0.1:{up}; keepalive 1024; keepalive_requests 1000000; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://up;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_cache off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def start_nginx(binary: str, tmp: Path, up_port: int, cores) -> tuple[subprocess.Popen, int]:
    d = tmp / f"nginx-{time.monotonic_ns()}"
    d.mkdir()
    os.chmod(d, 0o777)
    port = free_port()
    (d / "nginx.conf").write_text(NGINX_CONF.format(d=d, up=up_port, port=port))
    proc = subprocess.Popen(
        [binary, "-p", str(d), "-e", str(d / "error.log"), "-c", str(d / "nginx.conf"), "-g", "daemon off;"],
        preexec_fn=pin(cores), stdout=subprocess.DEVNULL, stderr=open(d / "stderr.log", "w"),
    )
    wait_port(port, proc)
    return proc, port


def start_specproxy(tmp: Path, up_port: int, cores, extra: list[str], python: str | list[str] | None = None,
                    ) -> tuple[subprocess.Popen, int, Path]:
    """``specproxy serve`` in front of the upstream; ``python``: the interpreter whose install of specproxy
    runs (another checkout's venv, ``--specproxy-baseline``), this one's by default; a list: the command
    that takes ``-m MODULE`` in its place (``overhead_steps.py``, ``--loop-steps``)."""
    port = free_port()
    db = tmp / f"specproxy-{time.monotonic_ns()}.db"
    runner = [python] if isinstance(python, str) else python or [sys.executable]
    cmd = [*runner, "-m", "specproxy.app.cli", "serve", "--upstream", f"http://127.0.0.1:{up_port}",
           "--port", str(port), "--db", str(db), "--tokenizer", "tiktoken:o200k_base", *extra]
    log = open(tmp / f"specproxy-{port}.log", "w")
    proc = subprocess.Popen(cmd, preexec_fn=pin(cores), stdout=log, stderr=log, cwd=str(tmp))
    wait_port(port, proc, timeout=60)
    return proc, port, db


def specproxy_state(proc: subprocess.Popen, tmp: Path, port: int, timeout: float = 5.0) -> dict[str, float] | None:
    """The state line ``specproxy serve`` logs on SIGUSR1 (its counters: the cadence poll's among them),
    parsed; None if none came within ``timeout``."""
    log = tmp / f"specproxy-{port}.log"

    def lines() -> list[str]:
        return [ln for ln in log.read_text(errors="replace").splitlines() if " state " in ln]

    before = len(lines())
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = lines()
        if len(got) > before:
            fields = (kv.split("=", 1) for kv in got[-1].split(" state ", 1)[1].split())
            return {k: float(v) for k, v in fields}
        time.sleep(0.02)
    return None


def sleep_until(t_ns: int) -> None:
    d = (t_ns - now_ns()) / 1e9
    if d > 0:
        time.sleep(d)


QUIET_WAITED = [0.0]


def wait_quiet(our_pids: list[int], limit_s: float, threshold: float = 0.15) -> float:
    """Wait (bounded) until processes other than ours use < threshold of a CPU; return the seconds waited."""
    t_begin = time.monotonic()
    budget = max(0.0, limit_s - QUIET_WAITED[0])
    while True:
        pids = [p for pid in our_pids for p in (pid, *children(pid))]
        m0, o0, t0 = machine_busy_s(), procs_cpu_s(pids), time.monotonic()
        time.sleep(0.3)
        m1, o1, t1 = machine_busy_s(), procs_cpu_s(pids), time.monotonic()
        other = ((m1 - m0) - cpu_between(o0, o1)) / (t1 - t0)
        waited = time.monotonic() - t_begin
        if other < threshold or waited >= budget:
            QUIET_WAITED[0] += waited
            return waited
        time.sleep(0.7)
