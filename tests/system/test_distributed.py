"""Data parallel training under torchrun, on CPU with gloo: 2 ranks (DDP and FSDP2) end with the same weights
and metrics as 1 process taking the same global batch; rank 0 alone writes; ranks sample differently; a
2-rank run resumes exactly; a checkpoint of 1 rank resumes on 2 and one of 2 on 1 with what it saved; 2-rank
runs of the CLI exit when they are done."""
import ctypes
import glob
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import distributed_worker
import pytest
import torch
from safetensors.torch import load_file
from tiny_setup import tiny_model, tiny_tokenizer
from tolerances import adamw_rounding, max_abs_diff

import grpo.rollout.engines.sampling
from grpo.errors import ConfigError
from grpo.infra.distributed import Distributed
from grpo.policy.parallel import ParallelPolicy, check_settings

TESTS = Path(__file__).resolve().parents[1]
# One torchrun for every 2-rank run (each start of it and its ranks costs seconds of imports): the `*_skip` runs and
# the elastic ones too, `elastic_one_to_two` last since it resumes a checkpoint the test process writes meanwhile.
TORCHRUN_RUNS = ["fixed_ddp", "fixed_fsdp", "fixed_fsdp_bf16", "fixed_ddp_lora", "sampled_ddp", "sampled_fsdp",
                 "resumed_ddp", "resumed_fsdp", "tools_ddp", "fixed_ddp_skip", "fixed_fsdp_skip", "elastic_two",
                 "elastic_one_to_two"]
SAME_METRICS = ["loss", "loss/policy", "kl", "grad_norm", "reward", "reward_std", "rewards/digit_share/std",
                "clip_ratio/region_mean", "ratio/mean", "entropy", "frac_reward_zero_std", "completions/mean_length",
                "completions/max_length", "completions/clipped_ratio", "learning_rate"]
# BASE's 2 AdamW steps at lr 1e-2 on 16 rows each: see tolerances.adamw_rounding
WEIGHT_BOUND = adamw_rounding(distributed_worker.BASE["max_steps"], distributed_worker.BASE["learning_rate"])


# --- one process: everything passes straight through --------------------------------------------------------


def test_single_process_is_a_no_op():
    single = Distributed()
    rows = {"prompt": ["a", "b"], "answer": ["1", "2"]}
    t = torch.arange(4.0)
    assert single.is_main and single.shard(rows) is rows
    assert single.gather(t) is t and single.local(t) is t
    assert single.gather_objects(["x"]) == ["x"] and single.reduce({"loss": 2.0}) == {"loss": 2.0}
    model = torch.nn.Linear(2, 1)
    policy = ParallelPolicy(model, single.world_size, fsdp=True)
    assert policy.kind == "single" and policy.root is None
    assert policy(lambda m: m) is model and policy.unsharded(lambda m: m) is model
    assert policy.full_state_dict() is None


def test_shard_gives_each_rank_whole_prompts_in_rank_order():
    rows = {"prompt": ["p0", "p1", "p2", "p3"], "answer": [0, 1, 2, 3]}
    assert Distributed(rank=0, world_size=2).shard(rows) == {"prompt": ["p0", "p1"], "answer": [0, 1]}
    assert Distributed(rank=1, world_size=2).shard(rows) == {"prompt": ["p2", "p3"], "answer": [2, 3]}
    assert Distributed(rank=1, world_size=2).local(torch.arange(6)).tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match="3 rows cannot be split evenly over 2 ranks"):
        Distributed(rank=0, world_size=2).shard({"prompt": ["a", "b", "c"]})


def test_fsdp_refuses_what_it_cannot_run_before_loading_anything():
    with pytest.raises(ConfigError, match='fsdp=true needs optim="adamw"'):
        check_settings(2, True, "adamw_8bit", use_lora=False)
    with pytest.raises(ConfigError, match="fsdp=true is for full fine-tuning"):
        check_settings(2, True, "adamw", use_lora=True)
    check_settings(1, True, "adamw_8bit", use_lora=True)  # one process: fsdp does not apply
    check_settings(2, False, "adamw_8bit", use_lora=True)
    check_settings(2, True, "adamw", use_lora=False)


# --- two ranks under torchrun -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The torchrun runs (2 ranks) and, meanwhile, their 1-process references, in out/<run name>; then the 2-rank
    run resumed in 1 process. `*_skip`: 2-rank runs (DDP, FSDP) where some ranks' micro-batches have no row with a
    gradient, and their 1-process reference. `elastic_*`: a 1-process run resumed on 2 ranks, and a 2-rank run
    resumed in 1 process (distributed_worker.py)."""
    out = tmp_path_factory.mktemp("dist")

    def meanwhile():
        distributed_worker.train(str(out), "elastic_one")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(grpo.rollout.engines.sampling, "sample_completions", distributed_worker.fixed_sample)
            for name in ["fixed_single", "fixed_single_lora", "fixed_single_skip"]:
                distributed_worker.train(str(out), name)
        distributed_worker.train(str(out), "tools_single")

    torchrun(out, TORCHRUN_RUNS, meanwhile)
    distributed_worker.resume_elsewhere(str(out), "elastic_two_to_one")
    return out


def killed_with_us() -> None:
    """In the torchrun child before it starts: SIGTERM when this test process dies (Linux's PR_SET_PDEATHSIG),
    which torchrun passes on to its ranks, so a test killed by a timeout (its SIGTERM runs no `finally`) leaves
    no rank behind."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def torchrun(out: Path, names: list[str], meanwhile=lambda: None) -> None:
    """distributed_worker.py's runs `names` on 2 ranks, calling `meanwhile()` in this process while they run."""
    log = out / "torchrun.log"
    launch = start_torchrun([str(TESTS / "distributed_worker.py"), str(out), *names], log)
    try:
        meanwhile()
        launch.wait(timeout=360)
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun timed out (ranks out of step?):\n{log.read_text()[-3000:]}")
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)  # torchrun and its ranks
    assert launch.returncode == 0, log.read_text()[-5000:]


def start_torchrun(args: list[str], log: Path, cpus: set[int] | None = None) -> subprocess.Popen:
    """`args` (a script or `-m MODULE`, and its arguments) on 2 ranks, their output in `log`; with `cpus`,
    torchrun and its ranks run on those CPUs alone."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")])}

    def before_start():
        killed_with_us()
        if cpus:
            os.sched_setaffinity(0, cpus)

    with open(log, "w") as sink:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 *args], env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=before_start)


def weights(run: Path, step: int = 2) -> dict:
    (path,) = glob.glob(str(run / f"checkpoint-{step}" / "*.safetensors"))
    return load_file(path)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def completion_rows(run: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    return sorted((r["step"], r["prompt"], r["completion"], round(r["reward"], 5), round(r["advantage"], 4))
                  for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("single, parallel", [("fixed_single", "fixed_ddp"), ("fixed_single", "fixed_fsdp"),
                                              ("fixed_single_lora", "fixed_ddp_lora")])
def test_two_ranks_match_one_process(runs, single, parallel):
    one, two = weights(runs / single), weights(runs / parallel)
    assert one.keys() == two.keys()
    worst = max_abs_diff(one, two)
    # The same gradients summed in another order (2 prompts forwarded at once in 1 process, 1 per rank, then
    # all-reduced): float rounding, which AdamW magnifies where a gradient nearly cancels. tolerances.py derives
    # steps * lr / 100 = 2e-4 (measured: 4.6e-6, 6.4e-6 with generic kernels, LoRA 7.9e-6; 8.1e-6 on a Xeon).
    # A bug (a row of the step's 16 dropped, one rank's gradient scaled) moves elements by ~lr / 16 = 6e-4 and
    # more (tried: rank 1's gradient scaled by 1.1, 1.2e-3; by 2, 7.7e-3).
    assert worst < WEIGHT_BOUND, f"max abs weight difference 1 vs 2 processes: {worst:.3g}"
    m1, m2 = metrics(runs / single), metrics(runs / parallel)
    assert [m["step"] for m in m2] == [1, 2], "rank 0 alone writes metrics"
    # Means over the step's ~200 tokens (and a norm), float32 summed per rank, then reduced: rounding ~sqrt(n) * u
    # = 1e-6 of them (n * u = 1.2e-5 the worst case, which random signs never near; measured <= 4.4% of the
    # bound). They catch what the weights' bound lets through: one rank's gradient scaled by 1.01 moved grad_norm
    # by 1% (the weights by 1.2e-4).
    for a, b in zip(m1, m2):
        for key in SAME_METRICS:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
    assert completion_rows(runs / parallel) == completion_rows(runs / single), "every rank's completions, once"
    assert sorted(p.name for p in (runs / parallel).glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["fixed_ddp_skip", "fixed_fsdp_skip"])
def test_ranks_left_without_rows_to_train_keep_in_step(runs, parallel):
    # One prompt's 4 completions per rank and micro-batch: every prompt whose group has equal rewards leaves its
    # rank's micro-batch with no row to train. The rank keeps one inert row so that DDP's and FSDP's collectives
    # run on every rank, and the run matches 1 process (which does no forward for such a micro-batch).
    one, two = weights(runs / "fixed_single_skip"), weights(runs / parallel)
    worst = max_abs_diff(one, two)
    # As test_two_ranks_match_one_process: steps * lr / 100 (tolerances.py; measured 7.5e-9, 1.5e-6 with generic
    # kernels); a rank's inert row that trained, or a collective a rank missed, would move its elements by ~lr.
    assert worst < WEIGHT_BOUND, f"max abs weight difference 1 vs 2 processes: {worst:.3g}"
    m1, m2 = metrics(runs / "fixed_single_skip"), metrics(runs / parallel)
    # Step 1: 3 of its 4 prompts' groups have equal rewards; step 2: all 4, so no token is trained (its update is
    # AdamW's on a zero gradient: momentum goes on) and the per-token metrics are 0.
    assert [m["skipped/zero_gradient"] for m in m1] == [0.75, 1.0]
    assert m1[0]["entropy"] > 0 and m1[1]["entropy"] == 0.0
    for a, b in zip(m1, m2):
        assert a.keys() == b.keys()
        for key in [k for k in SAME_METRICS if k in a] + ["skipped/zero_gradient"]:  # as above
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)


@pytest.mark.slow
def test_fsdp_under_the_bf16_plan_keeps_float32_master_weights(runs):
    # bf16 all-gathers and compute (MixedPrecisionPolicy), float32 reduction and shards: the saved weights stay
    # float32, and two steps move them as the float32 run does up to bf16 rounding of the gradients: bf16 sums
    # (u = 2**-8) of ~1000 terms err by ~sqrt(n) * u = 12% per element, which AdamW's per-element scaling passes on
    # to the updates; 0.25 is 2x that, cosine 0.98 about the same (measured: cosine 0.996, 9% relative
    # difference; a dropped or wrongly scaled update would be far off).
    initial = tiny_model(tiny_tokenizer()).state_dict()  # the worker's model, rebuilt
    exact, half = weights(runs / "fixed_fsdp"), weights(runs / "fixed_fsdp_bf16")
    assert all(t.dtype == torch.float32 for t in half.values())
    moved_exact = torch.cat([(exact[k] - initial[k]).flatten() for k in exact])  # [P]
    moved_half = torch.cat([(half[k] - initial[k]).flatten() for k in exact])  # [P]
    assert torch.nn.functional.cosine_similarity(moved_exact, moved_half, dim=0) > 0.98
    assert 0 < (moved_half - moved_exact).norm() / moved_exact.norm() < 0.25
    assert all(math.isfinite(m["loss"]) for m in metrics(runs / "fixed_fsdp_bf16"))


@pytest.mark.slow
def test_ranks_sample_differently_and_fsdp_samples_as_ddp(runs):
    # One repeated prompt, real sampling: with equal seeds both ranks' first micro-batches would be equal.
    ddp = [json.loads(line) for line in (runs / "sampled_ddp" / "completions.jsonl").read_text().splitlines()]
    assert len(ddp) == 2 * 2 * 4  # ranks x micro-batches x generations (one prompt each), rank-major
    assert [r["completion"] for r in ddp[:4]] != [r["completion"] for r in ddp[8:12]]
    # FSDP gathers the weights for generation: the same seeds must give the same completions as DDP, though
    # the ranks stop generating after different numbers of tokens.
    fsdp = [json.loads(line) for line in (runs / "sampled_fsdp" / "completions.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in fsdp] == [r["completion"] for r in ddp]
    one, two = load_file(runs / "sampled_ddp" / "checkpoint-1" / "model.safetensors"), \
        load_file(runs / "sampled_fsdp" / "checkpoint-1" / "model.safetensors")
    # 1 step of the same gradients, reduced by DDP's all-reduce or FSDP's reduce-scatter: rounding within
    # lr / 100 (tolerances.py); FSDP sampling or stepping other rows would differ by ~lr.
    assert max_abs_diff(one, two) < adamw_rounding(1, distributed_worker.BASE["learning_rate"])
    # Both evaluated greedily after the step (every rank the whole set), and then saved the checkpoint above.
    evals = [[m for m in metrics(runs / name) if "eval/accuracy" in m] for name in ("sampled_ddp", "sampled_fsdp")]
    assert [m["step"] for m in evals[0]] == [m["step"] for m in evals[1]] == [1]
    for key in ("eval/accuracy", "eval/length_mean", "eval/num_examples"):
        assert evals[1][0][key] == pytest.approx(evals[0][0][key]), key


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resumed_ddp", "resumed_fsdp"])
def test_two_ranks_resume_exactly(runs, name):
    # Died before step 4, resumed from checkpoint-3 (mid generation batch; step 5 samples anew).
    reference, resumed = runs / name / "reference", runs / name / "resumed"
    one, two = weights(reference, 6), weights(resumed, 6)
    assert all(torch.equal(one[k], two[k]) for k in one)
    assert [m["step"] for m in metrics(resumed)] == [1, 2, 3, 4, 5, 6]
    volatile = ("perf/", "memory/", "step_time")
    assert [{k: v for k, v in m.items() if not k.startswith(volatile)} for m in metrics(resumed)] == \
        [{k: v for k, v in m.items() if not k.startswith(volatile)} for m in metrics(reference)]
    assert (resumed / "completions.jsonl").read_text() == (reference / "completions.jsonl").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("name, saved_step", [("elastic_one_to_two", 1), ("elastic_two_to_one", 2)])
def test_resuming_on_another_number_of_ranks(runs, name, saved_step):
    # Exact continuation is not expected (sampling is seeded anew); what was saved must come back as saved.
    loaded = json.loads((runs / name / "loaded.json").read_text())
    assert loaded["weight_diff"] == 0.0 and loaded["optimizer_diff"] == 0.0, loaded
    assert loaded["optimizer_tensors"] > 0 and loaded["step"] == loaded["scheduler"] == saved_step
    assert len(set(loaded["seeds"])) == len(loaded["seeds"]), "ranks must sample differently"
    # 1 -> 2 resumes in the middle of a generation batch: its 4 prompts are drawn again, on 2 ranks.
    rewound = 4 if saved_step % 2 else 0
    assert loaded["prompts"]["position"] == loaded["saved_prompts"]["position"] - rewound
    assert [m["step"] for m in metrics(runs / name)] == list(range(saved_step + 1, 4))
    assert (runs / name / "checkpoint-3" / "COMPLETE").exists()


@pytest.mark.slow
def test_two_ranks_call_tools_as_one_process_does(runs):
    # Every completion calls the calculator once on either layout, its result fed into the row and counted
    # over both ranks; the completions and their rewards are those of one process.
    one, two = metrics(runs / "tools_single"), metrics(runs / "tools_ddp")
    assert [m["tools/call_frequency"] for m in two] == [m["tools/call_frequency"] for m in one] == [1.0, 1.0]
    assert [m["tools/failure_frequency"] for m in two] == [0.0, 0.0]
    assert completion_rows(runs / "tools_ddp") == completion_rows(runs / "tools_single")
    assert {r[2] for r in completion_rows(runs / "tools_ddp")} == {"<<3*4=12>>"}


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins both ranks to one CPU (Linux)")
def test_two_rank_cli_runs_exit_after_their_last_step(tmp_path):
    # Issue 60: a rank freed DDP's reducer, the process group's last holder, holding the GIL, while gloo's
    # worker thread needed the GIL to drop the last collective's tensors: the rank never exited, and only
    # SIGKILL ended it. Both ranks on one CPU make that interleaving likely (before the fix about one run in
    # four hung here, 6 in 10 on the machine): each of several runs must end soon after its last line.
    one_cpu = {min(os.sched_getaffinity(0))}
    for run in range(4):
        out, log = tmp_path / f"run{run}", tmp_path / f"run{run}.log"
        launch = start_torchrun(["-m", "grpo.train", str(TESTS.parent / "recipes" / "tiny.py"), "--max_steps=1",
                                 f"--output_dir={out}"], log, one_cpu)
        try:
            ended = ends_soon_after(launch, log, "done:")
        finally:
            if launch.poll() is None:
                os.killpg(launch.pid, signal.SIGKILL)
        assert ended, f"run {run}: a rank still running a minute after the last line:\n{log.read_text()[-3000:]}"
        assert launch.returncode == 0, log.read_text()[-3000:]


def ends_soon_after(launch: subprocess.Popen, log: Path, line: str, grace: float = 60, limit: float = 300) -> bool:
    """Whether `launch` ends within `grace` seconds of `line` showing in its log (and `limit` in all)."""
    start, seen = time.monotonic(), None
    while launch.poll() is None:
        now = time.monotonic()
        if seen is None and line in log.read_text():
            seen = now
        if now - start > limit or (seen is not None and now - seen > grace):
            return False
        time.sleep(0.2)
    return True
