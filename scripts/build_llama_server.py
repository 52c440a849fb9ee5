#!/usr/bin/env python3
"""Build (once) and cache a real llama.cpp ``llama-server`` for the ``real`` test tier.

Why this exists: the machines that run specproxy's tests reach PyPI, Debian and
npm but no model hub and no GitHub release page, so we cannot download a
prebuilt ``llama-server``.  The ``llama-cpp-python`` *sdist* on PyPI vendors the
whole llama.cpp tree (including tokenizer-only vocab GGUFs and chat templates),
so we fetch it with plain ``pip download`` and compile just the server target.

The result is cached under ``${SPECPROXY_CACHE:-~/.cache/specproxy}/llama-server-<version>/``::

    bin/llama-server          the statically linked (w.r.t. llama/ggml) server
    models/ggml-vocab-llama-bpe.gguf
    models/templates/meta-llama-Llama-3*.jinja
    build-info.json           what was built, how, and how long it took

Building takes minutes, so: a lock file keeps concurrent test sessions from
building twice, the build runs in a temporary directory next to the cache and
is moved into place with one ``rename`` (a half-finished build is never seen
as a cache hit), and progress goes to stderr.

Usage: ``python scripts/build_llama_server.py [--force]``; prints the binary path.
Set ``SPECPROXY_LLAMA_SDIST=/path/to/llama_cpp_python-<v>.tar.gz`` to build from
a local sdist instead of asking PyPI.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

# The one pin.  llama-cpp-python 0.3.36 vendors llama.cpp 0.5.0-dev.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"

# Files we keep from the source tree (relative to vendor/llama.cpp/models).
VOCAB_FILES = ("ggml-vocab-llama-bpe.gguf",)
TEMPLATE_GLOB = "meta-llama-Llama-3*.jinja"

# Deadlines.  They are generous because a cold 2-core build is ~7 minutes, but
# they exist so a wedged compiler or a hung pip never blocks CI forever.
PIP_DEADLINE_S = 15 * 60
CONFIGURE_DEADLINE_S = 10 * 60
BUILD_DEADLINE_S = 60 * 60
LOCK_DEADLINE_S = BUILD_DEADLINE_S + PIP_DEADLINE_S + CONFIGURE_DEADLINE_S

# Why each flag: no network at build time (prebuilt web UI comes from a model
# hub, OpenSSL/curl only serve model downloads), no tests/examples (time), and
# static llama/ggml libs so the single binary can be copied into the cache.
# GGML_NATIVE=OFF keeps the cached binary valid if the cache directory ends up
# on a machine with a different CPU; the tiny test models don't need AVX512.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",  # deprecated+ignored in this version; harmless, kept for older pins
)


class BuildError(RuntimeError):
    """A build step failed; ``str(err)`` is a one-line, user-facing reason."""


def log(msg: str) -> None:
    print(f"[build_llama_server] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    return Path(os.environ.get("SPECPROXY_CACHE") or Path.home() / ".cache" / "specproxy")


def cache_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return cache_root() / f"llama-server-{version}"


def cached_binary(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path | None:
    """Return the cached binary if a *complete* build is present, else None.

    build-info.json is written last, before the atomic rename, so its presence
    plus an executable binary means the directory is complete.
    """
    d = cache_dir(version)
    exe = d / "bin" / "llama-server"
    if (d / "build-info.json").is_file() and exe.is_file() and os.access(exe, os.X_OK):
        return exe
    return None


def preflight() -> dict[str, str]:
    """Find the tools we need, failing fast with one line instead of a cmake trace."""
    tools = {}
    cmake = shutil.which("cmake")
    if not cmake:
        raise BuildError("cmake not found on PATH (apt-get install cmake)")
    tools["cmake"] = cmake
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cxx or not cc:
        raise BuildError("no C/C++ compiler found on PATH (apt-get install g++)")
    tools["cxx"], tools["cc"] = cxx, cc
    if importlib.util.find_spec("pip") is None:
        raise BuildError(f"pip is not available in {sys.executable} (needed to fetch the llama.cpp source)")
    ninja = shutil.which("ninja")
    if ninja:
        tools["ninja"] = ninja
    return tools


def _run_logged(cmd: list[str], *, cwd: Path, logfile: Path, deadline_s: float,
                step: str, env: dict[str, str] | None = None) -> None:
    """Run ``cmd`` writing all output to ``logfile``; echo throttled progress to stderr.

    Why throttled: a full compile log is hundreds of lines and would bury the
    pytest output; we show ``[n/m]`` progress at most every ~10 s or 10 %.
    On failure the log's tail is shown, then a one-line BuildError is raised.
    """
    start = time.monotonic()
    last_shown_t, last_shown_pct = 0.0, -100.0
    progress = re.compile(r"^\[\s*(\d+)\s*/\s*(\d+)\]|^\[\s*(\d+)%\]")
    with open(logfile, "a", encoding="utf-8", errors="replace") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        # Own process group, so a kill reaches ninja's compiler children too
        # (they hold the pipe open; killing only cmake would not end the read).
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT, text=True, errors="replace",
                                start_new_session=True)
        assert proc.stdout is not None

        def kill_group() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        # A watchdog enforces the deadline even if the child hangs silently
        # (readline() below would otherwise block forever); killing the group
        # closes the pipe, which ends the read loop.
        watchdog = threading.Timer(deadline_s, kill_group)
        watchdog.daemon = True
        watchdog.start()
        try:
            for line in iter(proc.stdout.readline, ""):  # "" only at EOF, i.e. child exit
                fh.write(line)
                m = progress.match(line)
                if m:
                    elapsed = time.monotonic() - start
                    pct = (100.0 * int(m[1]) / int(m[2])) if m[1] else float(m[3])
                    if pct - last_shown_pct >= 10 or elapsed - last_shown_t >= 10:
                        log(f"{step}: {pct:5.1f}% ({elapsed:4.0f}s) {line.strip()[:100]}")
                        last_shown_t, last_shown_pct = elapsed, pct
            rc = proc.wait(timeout=60)
        except BaseException:  # e.g. Ctrl-C: don't leave compilers running
            kill_group()
            proc.wait(timeout=30)
            raise
        finally:
            watchdog.cancel()
    if time.monotonic() - start >= deadline_s:
        raise BuildError(f"{step} exceeded its {deadline_s:.0f}s deadline and was killed (log: {logfile})")
    if rc != 0:
        tail = logfile.read_text(encoding="utf-8", errors="replace").splitlines()[-40:]
        for t in tail:
            print(f"    | {t}", file=sys.stderr)
        raise BuildError(f"{step} failed with exit code {rc} (full log: {logfile})")
    log(f"{step}: done in {time.monotonic() - start:.0f}s")


def _download_sdist(version: str, dest: Path, logfile: Path) -> Path:
    """``pip download`` the sdist; SPECPROXY_LLAMA_SDIST may point at a local copy."""
    local = os.environ.get("SPECPROXY_LLAMA_SDIST")
    if local:
        p = Path(local)
        if not p.is_file():
            raise BuildError(f"SPECPROXY_LLAMA_SDIST={local} is not a file")
        return p
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-input",
           "--no-deps", "--no-binary", ":all:",
           f"llama-cpp-python=={version}", "-d", str(dest)]
    log(f"downloading llama-cpp-python=={version} sdist with pip (~75 MB)")
    _run_logged(cmd, cwd=dest, logfile=logfile, deadline_s=PIP_DEADLINE_S, step="pip download")
    found = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise BuildError(f"pip download produced no llama_cpp_python sdist in {dest}")
    return found[0]


def _extract_llama_cpp(sdist: Path, dest: Path) -> Path:
    """Extract only ``vendor/llama.cpp`` from the sdist and return its path."""
    log(f"extracting vendor/llama.cpp from {sdist.name}")
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
        if not members:
            raise BuildError(f"{sdist.name} has no vendor/llama.cpp (unexpected sdist layout)")
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: refuse unsafe paths/links
            tf.extractall(dest, members=members, filter="data")
        else:
            for m in members:
                if m.name.startswith(("/", "..")) or ".." in Path(m.name).parts or m.islnk() or m.issym():
                    raise BuildError(f"refusing suspicious sdist member {m.name!r}")
            tf.extractall(dest, members=members)
    roots = list(dest.glob("*/vendor/llama.cpp"))
    if len(roots) != 1 or not (roots[0] / "CMakeLists.txt").is_file():
        raise BuildError("vendor/llama.cpp/CMakeLists.txt missing after extraction")
    return roots[0]


def _build(src: Path, build: Path, tools: dict[str, str], logfile: Path, jobs: int) -> Path:
    env = dict(os.environ)
    # The sdist has no .git; stop git (used by llama.cpp's build-info) from
    # walking up into an unrelated repository and stamping its commit.
    env["GIT_CEILING_DIRECTORIES"] = str(src.parent)
    gen = ["-G", "Ninja"] if "ninja" in tools else []
    cfg = [tools["cmake"], "-S", str(src), "-B", str(build), *gen, *CMAKE_FLAGS,
           f"-DCMAKE_C_COMPILER={tools['cc']}", f"-DCMAKE_CXX_COMPILER={tools['cxx']}"]
    log("configuring with cmake")
    _run_logged(cfg, cwd=src, logfile=logfile, deadline_s=CONFIGURE_DEADLINE_S,
                step="cmake configure", env=env)
    log(f"compiling llama-server with -j{jobs} (a few minutes on 2 cores)")
    bld = [tools["cmake"], "--build", str(build), "--target", "llama-server", "-j", str(jobs)]
    _run_logged(bld, cwd=src, logfile=logfile, deadline_s=BUILD_DEADLINE_S,
                step="cmake build", env=env)
    exe = build / "bin" / "llama-server"
    if not exe.is_file():
        raise BuildError(f"build finished but {exe} does not exist")
    return exe


class _BuildLock:
    """An ``flock`` on a file beside the cache dir, acquired with a deadline.

    flock is released by the kernel if the holder dies, so a crashed build never
    leaves a stale lock behind.
    """

    def __init__(self, path: Path, deadline_s: float) -> None:
        self.path, self.deadline_s, self.fh = path, deadline_s, None

    def __enter__(self) -> "_BuildLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(self.path, "a+")
        end = time.monotonic() + self.deadline_s
        announced = False
        while True:
            try:
                fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > end:
                    self.fh.close()
                    raise BuildError(f"timed out after {self.deadline_s:.0f}s waiting for build lock {self.path}")
                if not announced:
                    log(f"another process is building; waiting on {self.path}")
                    announced = True
                # Polling: flock has no timed wait.  The condition is re-checked
                # each round; 1 s granularity is fine against a minutes-long build.
                time.sleep(1.0)

    def __exit__(self, *exc: object) -> None:
        assert self.fh is not None
        fcntl.flock(self.fh, fcntl.LOCK_UN)
        self.fh.close()


def ensure_llama_server(version: str = LLAMA_CPP_PYTHON_VERSION, *, force: bool = False,
                        jobs: int | None = None, keep_build: bool = False) -> Path:
    """Return the path to a cached ``llama-server``, building it first if needed.

    Raises BuildError (one-line message) when the build is impossible here.
    """
    if not force and (exe := cached_binary(version)):
        return exe
    if platform.system() not in ("Linux", "Darwin"):
        raise BuildError(f"building llama-server is only supported on Linux/macOS, not {platform.system()}")
    tools = preflight()
    root = cache_root()
    final = cache_dir(version)
    with _BuildLock(root / f"llama-server-{version}.lock", LOCK_DEADLINE_S):
        # Someone else may have finished while we waited for the lock.
        if not force and (exe := cached_binary(version)):
            return exe
        t0 = time.monotonic()
        # We hold the lock, so older build dirs of this version are leftovers of
        # failed builds (kept for inspection); drop them before they pile up (~1 GB each).
        for old in root.glob(f".build-llama-server-{version}-*"):
            shutil.rmtree(old, ignore_errors=True)
        # Same filesystem as the cache => the final os.rename is atomic.
        work = Path(tempfile.mkdtemp(prefix=f".build-llama-server-{version}-", dir=root))
        logfile = work / "build.log"
        log(f"building llama-server {version} in {work} (log: {logfile})")
        ok = False
        try:
            sdist = _download_sdist(version, work / "dl", logfile)
            src = _extract_llama_cpp(sdist, work / "src")
            exe = _build(src, work / "build", tools, logfile, jobs or min(2, os.cpu_count() or 1))
            stage = work / "stage"
            (stage / "bin").mkdir(parents=True)
            (stage / "models" / "templates").mkdir(parents=True)
            shutil.copy2(exe, stage / "bin" / "llama-server")
            for name in VOCAB_FILES:
                shutil.copy2(src / "models" / name, stage / "models" / name)
            templates = sorted((src / "models" / "templates").glob(TEMPLATE_GLOB))
            for t in templates:
                shutil.copy2(t, stage / "models" / "templates" / t.name)
            info = {
                "llama_cpp_python_version": version,
                "cmake_flags": list(CMAKE_FLAGS),
                "build_seconds": round(time.monotonic() - t0, 1),
                "binary_bytes": (stage / "bin" / "llama-server").stat().st_size,
                "templates": [t.name for t in templates],
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "machine": platform.machine(),
            }
            (stage / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
            if final.exists():
                # Only reachable with --force or an incomplete leftover; move it
                # aside first so the rename below stays a single atomic step.
                shutil.rmtree(final)
            os.rename(stage, final)
            ok = True
            log(f"cached {final} ({info['build_seconds']:.0f}s, binary {info['binary_bytes'] / 1e6:.1f} MB)")
        finally:
            if ok and not keep_build:
                shutil.rmtree(work, ignore_errors=True)
            elif not ok:
                log(f"build directory kept for inspection: {work}")
    exe = cached_binary(version)
    if exe is None:
        raise BuildError(f"cache {final} is incomplete after build")
    return exe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION,
                    help="llama-cpp-python sdist version whose vendored llama.cpp to build")
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    ap.add_argument("--jobs", "-j", type=int, default=None, help="parallel compile jobs (default: min(2, cpus))")
    ap.add_argument("--keep-build", action="store_true", help="keep the temporary build tree")
    args = ap.parse_args(argv)
    try:
        exe = ensure_llama_server(args.version, force=args.force, jobs=args.jobs, keep_build=args.keep_build)
    except BuildError as e:
        print(f"error: cannot build llama-server: {e}", file=sys.stderr)
        return 1
    print(exe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
