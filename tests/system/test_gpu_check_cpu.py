"""benchmarks/gpu_check.py rehearsed on CPU (`--device cpu --tiny`): its processes, recipe template, dtype and
update checks and judgement run end to end on small models (the CUDA figures themselves need a GPU)."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


@pytest.mark.slow
def test_the_cpu_rehearsal_passes_the_out_of_memory_qlora_and_shared_prompt_checks(tmp_path, capsys):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--device", "cpu", "--tiny", "--only", "oom", "qlora", "shared", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [c["name"] for c in report["checks"]] == ["oom", "qlora", "shared"]
    assert all(c["passed"] for c in report["checks"])
    oom, qlora, shared = (c["result"] for c in report["checks"])
    assert [(r["attention"], r["layout"]) for r in shared["rows"]] == [("sdpa", "padded"), ("sdpa", "packed")]
    assert oom["returncode"] == 1 and "error: out of GPU memory in step 1" in oom["stderr"]
    assert qlora["changed_fraction"] == 1.0 and qlora["dtype_problems"] == []
    assert "oom              PASS   error: out of GPU memory in step 1" in capsys.readouterr().out
