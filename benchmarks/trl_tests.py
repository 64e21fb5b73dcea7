"""TRL's own GRPOTrainer test file, run on TRL 1.16 and on grpo with the import swapped as docs/coming-from-trl.md
says, offline, on tiny random stand-ins for TRL's tiny Hub models and its `zen` data sets. The figure: of the
tests that pass on TRL, how many pass on grpo, and grpo's failures grouped by the first line of their error.

TRL is a peer here, never a dependency: it is installed into a virtual environment of its own (made once,
`python -m venv --system-site-packages` + `pip install --no-deps trl==1.16.0`), and both runs use that
environment's python; the grpo run differs from the TRL run only in the swapped import line (TRL's other helper
imports, such as `trl.import_utils`, still resolve there). grpo is imported from this checkout (PYTHONPATH).

    python benchmarks/trl_tests.py --test-file /tmp/trl-port-src/test_grpo_trainer.py
    python benchmarks/trl_tests.py --test-file ... --limit 40           # every k-th test, 40 in all
    python benchmarks/trl_tests.py --test-file ... -k "loss_type or beta"
    python benchmarks/trl_tests.py --test-file ... --trainer trl        # one side only

Stand-ins (benchmarks/trl_tests/standins.py): text models only; the vision-language tests fail on TRL too, so
they stay out of the measure. Results: benchmarks/results/trl_tests.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "benchmarks" / "trl_tests"
RESULTS = ROOT / "benchmarks" / "results"
TRL_IMPORT = "from trl import GRPOConfig, GRPOTrainer\n"
GRPO_IMPORT = "from grpo import Config as GRPOConfig, Trainer as GRPOTrainer\n"
FILE = "test_grpo_trainer.py"


def trl_venv(folder: Path, requirement: str) -> Path:
    """The python of a venv holding TRL over the system packages, made on first use."""
    python = folder / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(folder)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", requirement], check=True)
    return python


def prepare(work: Path, test_file: Path, trainer: str) -> Path:
    """A pytest root holding TRL's test file (imports swapped for grpo) and the harness's helpers."""
    tests = work / f"tests_{trainer}"
    shutil.rmtree(tests, ignore_errors=True)
    tests.mkdir(parents=True)
    (tests / "__init__.py").write_text("")
    for name in ("testing_utils.py", "conftest.py"):
        shutil.copy(HELPERS / name, tests / name)
    text = test_file.read_text()
    if TRL_IMPORT not in text:
        raise SystemExit(f"{test_file} has no line {TRL_IMPORT.strip()!r} to swap")
    if trainer == "grpo":
        text = text.replace(TRL_IMPORT, GRPO_IMPORT)
    (tests / FILE).write_text(text)
    return tests


def environment(work: Path) -> dict[str, str]:
    env = dict(os.environ, HF_HOME=str(work / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TRL_TESTS_DATA=str(work / "data"), WANDB_MODE="disabled",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def collect(python: Path, tests: Path, env: dict, keyword: str | None) -> list[str]:
    """The test ids TRL's file holds (the part after `test_grpo_trainer.py::`), -k applied."""
    cmd = [str(python), "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", FILE]
    out = subprocess.run(cmd + (["-k", keyword] if keyword else []), env=env, cwd=tests,
                         capture_output=True, text=True)
    ids = [line.split(".py::", 1)[1] for line in out.stdout.splitlines() if ".py::" in line]
    if not ids:
        raise SystemExit(f"collected no tests:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return ids


def run(python: Path, tests: Path, env: dict, ids: list[str], seconds: int) -> dict[str, dict]:
    """Each test id -> {"outcome": passed/failed/skipped, "error": the first line of its error}."""
    report = tests.parent / f"{tests.name}.xml"
    cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", "--tb=no",
           f"--junitxml={report}", "-o", "junit_family=xunit1", *(f"{FILE}::{i}" for i in ids)]
    subprocess.run(cmd, env=dict(env, TRL_TESTS_TIMEOUT=str(seconds)), cwd=tests)
    results = {}
    for case in ET.parse(report).iter("testcase"):
        scope = case.get("classname").split(FILE[:-3], 1)[-1].lstrip(".").replace(".", "::")
        name = f"{scope}::{case.get('name')}" if scope else case.get("name")
        outcome, error = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "skipped" if child.tag == "skipped" else "failed"
                error = (child.get("message") or child.text or "").strip().splitlines()[:1]
                error = error[0][:200] if error else child.tag
        results[name] = {"outcome": outcome, "error": error}
    return results


def pick(ids: list[str], limit: int | None) -> list[str]:
    """Every k-th test, spread over the whole file, when a limit is set."""
    if not limit or limit >= len(ids):
        return ids
    return [ids[round(i * len(ids) / limit)] for i in range(limit)]


def summary(trl: dict, grpo: dict | None) -> dict:
    passing = sorted(t for t, r in trl.items() if r["outcome"] == "passed")
    out = {"tests_run_on_trl": len(trl), "passing_on_trl": len(passing)}
    if grpo is None:
        return out
    failures = {t: grpo.get(t, {"outcome": "failed", "error": "not run"}) for t in passing}
    failures = {t: r for t, r in failures.items() if r["outcome"] != "passed"}
    causes = collections.defaultdict(list)
    for test, r in failures.items():
        causes[r["error"] if r["outcome"] == "failed" else f"skipped: {r['error']}"].append(test)
    out.update(passing_on_grpo=len(passing) - len(failures),
               grpo_failures_by_cause=dict(sorted(causes.items(), key=lambda kv: -len(kv[1]))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--test-file", type=Path, required=True, help="TRL's tests/test_grpo_trainer.py")
    parser.add_argument("--trainer", choices=["both", "trl", "grpo"], default="both")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression, as in pytest")
    parser.add_argument("--limit", type=int, help="run this many tests, spread evenly over the file")
    parser.add_argument("--timeout", type=int, default=300, help="seconds one test may take")
    parser.add_argument("--trl", default="trl==1.16.0", help="what pip installs into TRL's venv (or a wheel)")
    parser.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "trl-tests-venv")
    parser.add_argument("--work", type=Path, help="folder for the cache and copies (default: a temp folder)")
    parser.add_argument("--out", type=Path, default=RESULTS / "trl_tests.json")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="trl-tests-"))
    sys.path[:0] = [str(ROOT), str(HELPERS)]
    import standins

    python, env = trl_venv(args.venv, args.trl), environment(work)
    trl_package = subprocess.run([str(python), "-c", "import trl, os; print(os.path.dirname(trl.__file__))"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    missing = standins.write_models(work / "hf" / "hub", Path(trl_package) / "chat_templates")
    standins.write_datasets(work / "data")
    ids = pick(collect(python, prepare(work, args.test_file, "trl"), env, args.keyword), args.limit)
    start, trl, grpo = time.time(), None, None
    if args.trainer in ("both", "trl"):
        trl = run(python, work / "tests_trl", env, ids, args.timeout)
    if args.trainer in ("both", "grpo"):
        passing = ids if trl is None else [i for i in ids if trl.get(i, {}).get("outcome") == "passed"]
        grpo = run(python, prepare(work, args.test_file, "grpo"), env, passing, args.timeout) if passing else {}
    result = {"command": " ".join(sys.argv), "selected": len(ids), "keyword": args.keyword, "limit": args.limit,
              "stand_ins_not_built": missing, "seconds": round(time.time() - start),
              **summary(trl or {}, grpo), "trl": trl, "grpo": grpo}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"selected {len(ids)} tests; passing on TRL {result['passing_on_trl']}", end="")
    if grpo is not None and trl is not None:
        print(f"; of those, passing on grpo {result['passing_on_grpo']}")
        for cause, tests in result["grpo_failures_by_cause"].items():
            print(f"  {len(tests):3d}  {cause}")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
