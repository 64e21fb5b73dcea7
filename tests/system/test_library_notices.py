"""Lines libraries log at import that name nothing to fix reach no terminal of `grpo.train`, `grpo.eval` or
`grpo.export`. bitsandbytes logs its line only on a CPU with AVX512-BF16 (with `kernels` installed and offline,
`kernels` logs one too), so each command runs as a user runs it, with bitsandbytes' own test of the CPU answering
yes, then no: the same on any machine."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTICE = "Failed to load CPU gemm_4bit_forward"  # bitsandbytes' line, in full when the library logs it
# What the libraries' lines that name nothing to fix hold: bitsandbytes' and `kernels`', transformers' own
# (prefixed so) and datasets' bar while it reads a data file.
FOREIGN = ("kernels-community", "bitsandbytes", "[transformers]", "Generating train split")

# Run before anything is imported: bitsandbytes.functional.has_avx512bf16, which its CPU backend asks at import
# whether to fetch a Hub kernel, answers ANSWER.
CPU = """
import importlib.machinery, runpy, sys

class CPU:
    def find_spec(self, name, path, target=None):
        if name != "bitsandbytes.functional":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            module.has_avx512bf16 = lambda: ANSWER

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, CPU())
"""
MODULE = "sys.argv = sys.argv[1:]\nrunpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"


def run(avx512_bf16: bool, then: str, *args: str) -> subprocess.CompletedProcess:
    """`python -c CPU + then ARGS` with HF_HUB_OFFLINE=1 (no Hub kernel can be fetched, none is asked for)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", CPU.replace("ANSWER", str(avx512_bf16)) + then, *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # five processes that import torch and transformers, per side
@pytest.mark.parametrize("avx512_bf16", [True, False])
def test_no_library_notice_reaches_the_terminal(tmp_path, avx512_bf16):
    library = run(avx512_bf16, "import peft")  # the seam holds: without grpo the library logs it, on that side
    assert library.returncode == 0, library.stderr[-2000:]
    assert (NOTICE in library.stderr) == avx512_bf16, library.stderr[-2000:]

    out, rows = tmp_path / "run", tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "Write 3 digits:", "num_digits": 3}\n')
    commands = [
        ("grpo.train", "recipes/tiny.py", "--max_steps=1", "--save_steps=1", f"--output_dir={out}",
         "--num_generations=2", "--optim=adamw_8bit"),  # 8-bit AdamW imports bitsandbytes itself
        ("grpo.eval", "--checkpoint", str(out / "checkpoint-1"), "--eval_dataset", str(rows), "--reward_funcs",
         "recipes.tiny.digit_count"),
        ("grpo.export", str(out / "checkpoint-1"), "--merged", str(tmp_path / "merged")),
    ]
    # Where the library logs nothing (the "no" side) one command shows the seam changes nothing else: the other two
    # import what grpo.train imports.
    for command in commands if avx512_bf16 else commands[:1]:
        result = run(avx512_bf16, MODULE, *command)
        assert result.returncode == 0, result.stderr[-2000:]
        seen = [text for text in FOREIGN if text in result.stderr]
        assert not seen, f"{command[0]}: {result.stderr[-2000:]}"
