"""`python -m grpo.generate`: a checkpoint tried on a prompt from the command line, with its recipe's tools run in
the decode and what they wrote marked; and `python -m grpo.export` of a run that called tools says in one line
that nothing outside grpo runs them. A run of one step on a scripted model (tests/scripted.py) that writes
`<<3*4=` after the prompt, so that the inline calculator answers."""
import subprocess
import sys

import pytest
from scripted import chain, scripted_model, scripted_tokenizer

pytestmark = pytest.mark.slow  # a run in a subprocess, an export and two generations
PROMPT = "Compute 3*4: "
RECIPE = """
from datasets import Dataset
from grpo import Config
from grpo.tasks.calculator import INLINE_CALCULATOR

config = Config(model={model!r}, output_dir={output!r}, use_lora=True, lora_r=4, max_steps=1, save_steps=1,
                optim="adamw", per_device_train_batch_size=4, num_generations=2, max_completion_length=8, seed=0)
train_dataset = Dataset.from_list([{{"prompt": [{{"role": "system", "content": "Use <<>>."}},
                                               {{"role": "user", "content": {prompt!r}}}]}}] * 4)
tools = [INLINE_CALCULATOR]


def by_place(completions, **kwargs):
    return [i / len(completions) for i in range(len(completions))]


reward_funcs = [by_place]
"""


def run(module: str, *args: str, code: int = 0) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == code, done.stderr[-3000:]
    return done


def run_here(main, capfd, *args: str) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` (whose `main` this is) in this process, with what it writes to file descriptors
    1 and 2: a start of Python and torch costs seconds, and the command line holds nothing but `main`."""
    capfd.readouterr()
    code = main(list(args))
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    return subprocess.CompletedProcess(args, code, out, err)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The recipe (the scripted model, the inline calculator) and the checkpoint of its one-step run."""
    root = tmp_path_factory.mktemp("generate")
    tokenizer = scripted_tokenizer("<<", "3*4")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                           tokenize=False)
    model = scripted_model(tokenizer, chain(tokenizer, prompt, "<<", "3*4", "="))
    model.save_pretrained(root / "scripted")
    tokenizer.save_pretrained(root / "scripted")
    recipe = root / "recipe.py"
    recipe.write_text(RECIPE.format(model=str(root / "scripted"), output=str(root / "run"), prompt=PROMPT))
    run("grpo.train", str(recipe))
    return recipe, root / "run" / "checkpoint-1"


def test_a_checkpoint_completes_a_prompt_with_its_recipes_tools_marked(trained, capfd):
    from grpo.generate import main

    recipe, checkpoint = trained
    done = run_here(main, capfd, "--checkpoint", str(checkpoint), "--recipe", str(recipe), "--prompt", PROMPT)
    assert done.stdout == "<<3*4=[tool: 12>>]\n", done.stdout
    assert "prompt: the recipe's first 1 message(s) (system)" in done.stderr, done.stderr  # as it was trained
    alone = run_here(main, capfd, f"--checkpoint={checkpoint}", f"--prompt={PROMPT}")  # the settings it saved
    assert alone.stdout == "<<3*4=\n", alone.stdout  # no tools without the recipe, and a line saying so
    notes = [line for line in alone.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "calculate" in notes[0] and "--recipe" in notes[0], alone.stderr


def test_generate_without_a_model_says_how_to_name_one(capsys):
    from grpo.generate import main

    assert main([f"--prompt={PROMPT}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: name the model: --checkpoint DIR") and len(err.strip().splitlines()) == 1, err


def test_export_of_a_run_that_called_tools_says_that_only_grpo_runs_them(trained, tmp_path, capfd):
    from grpo.export import main

    recipe, checkpoint = trained
    done = run_here(main, capfd, str(checkpoint), "--merged", str(tmp_path / "merged"))
    notes = [line for line in done.stdout.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "calculate as <<...=" in notes[0] and "grpo.generate" in notes[0], done.stdout
