"""How llama-server's aggregate throughput scales with concurrency on this machine: the README's ``bench``
line against a 4-slot llama-server on the test suite's tiny reciting model, and the ratio of the
aggregate at 2 and 4 streams to the one at 1.

    python scripts/bench_real_sweep.py                 # 1 run (~30 s once llama-server is built)
    python scripts/bench_real_sweep.py --runs 3

Why a script and not a test: the ratio is a property of the server and of how busy the machine is
(1.8-2.1x at 4 streams on a quiet 2-core VM, 1.2x while other work competed for the cores), not of
specproxy; tests/real/test_bench_real.py asserts what specproxy decides about the same run (each printed
aggregate equals what its stored turns say). This reports and never fails on a figure.

llama-server comes from the suite's cache (``~/.cache/specproxy``; built on first use, minutes), the
models and tokenizer from ``tests/real`` (made locally, nothing downloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from real.fixtures import TINY_SENTENCE, VOCAB_NAME, _build_module, _cached_model  # noqa: E402
from real.server import LlamaServer  # noqa: E402
from real.tiny_model import make_hf_tokenizer_dir  # noqa: E402

_FIGURE = r"(\d+\.\d+) \[\d+\.\d+, \d+\.\d+\]"
# concurrency, turns, errors, per-stream [CI], TTFT [CI], aggregate [CI], what the intervals are over
ROW = re.compile(rf"\s+(\d+)\s+\d+\s+\d+\s+{_FIGURE}\s+\S+ \[\S+, \S+\]\s+{_FIGURE}")


def readme_bench_words() -> list[str]:
    (line,) = [ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("specproxy bench ")]
    return shlex.split(line)


def one_run(url: str, tokenizer_dir: Path, work: Path, db: Path) -> dict[int, tuple[float, float]]:
    """{concurrency: (per-stream median, aggregate)} as the README's bench line prints them."""
    swap = {"http://127.0.0.1:8000": url, "turns.jsonl": str(work), "hf:/path/to/model-dir": f"hf:{tokenizer_dir}"}
    args = [swap.get(w, w) for w in readme_bench_words()[1:]]
    proc = subprocess.run([sys.executable, "-m", "specproxy.app.cli", *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env={**os.environ, "SPECPROXY_DB": str(db)})
    if proc.returncode != 0:
        sys.exit(f"bench_real_sweep: bench failed: {proc.stderr.strip().splitlines()[-1:]}")
    rows = {}
    for line in proc.stdout.splitlines():
        if m := ROW.match(line):
            rows[int(m[1])] = (float(m[2]), float(m[3]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1, help="bench runs, each on a fresh database")
    args = ap.parse_args()
    build = _build_module()
    exe = build.cached_binary() or build.ensure_llama_server()
    assets = exe.parent.parent / "models"
    model = _cached_model(assets, sentence=TINY_SENTENCE, end_with_eot=True, seed=0)
    with tempfile.TemporaryDirectory(prefix="specproxy-sweep-") as tmp:
        tmp = Path(tmp)
        tok = make_hf_tokenizer_dir(assets / VOCAB_NAME, tmp / "tok")
        work = tmp / "turns.jsonl"
        work.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}: say something."}],
                                            "max_tokens": 32, "stream": True, "ignore_eos": True}) + "\n"
                                for i in range(3)))
        print(f"4-slot llama-server, tiny model, 32 tokens a turn; {os.cpu_count()} CPUs; load average "
              f"{os.getloadavg()[0]:.1f} at the start")
        print(f"{'run':>4}  {'c=1 agg':>9}  {'c=2 agg':>9}  {'c=4 agg':>9}  {'c=2/c=1':>8}  {'c=4/c=1':>8}")
        with LlamaServer(exe, model.path, parallel=4, n_ctx=1024) as srv:
            for run in range(1, args.runs + 1):
                rows = one_run(srv.url, tok, work, tmp / f"run{run}.db")
                agg = {level: rows[level][1] for level in (1, 2, 4) if level in rows}
                if len(agg) < 3:
                    print(f"{run:>4}  levels missing from bench's table: {sorted(agg)}")
                    continue
                print(f"{run:>4}  {agg[1]:>9.1f}  {agg[2]:>9.1f}  {agg[4]:>9.1f}  {agg[2] / agg[1]:>7.2f}x  "
                      f"{agg[4] / agg[1]:>7.2f}x")


if __name__ == "__main__":
    main()
