import dataclasses
import json
import math
import re
import sys
import textwrap
from pathlib import Path

import pytest

from grpo.settings import Config
from grpo.errors import ConfigError
from grpo.settings.cli import apply_overrides, format_help, format_value
from grpo.settings.recipe import Recipe, load_recipe, resolve_dataset

# --- overrides -----------------------------------------------------------------------------------


def test_overrides_of_every_type():
    config = apply_overrides(Config(), [
        "--model=tiny/model",  # str
        "--learning_rate=1e-5",  # float in scientific notation
        "--adam_beta2=0.95",
        "--num_generations=4",  # int
        "--max_steps=-1",
        "--bf16=false",  # bool
        "--use_lora",  # bare flag -> True
        "--epsilon_high=0.28",
        "--save_total_limit=3",  # int | None
        "--reward_weights=1,0.5",  # list[float] | None
        "--lora_target_modules=q_proj,v_proj",  # list[str] | None
    ])
    assert config.model == "tiny/model"
    assert config.learning_rate == 1e-5
    assert config.adam_beta2 == 0.95
    assert config.num_generations == 4 and isinstance(config.num_generations, int)
    assert config.max_steps == -1
    assert config.bf16 is False and config.use_lora is True
    assert config.save_total_limit == 3
    assert config.reward_weights == [1.0, 0.5]
    assert config.lora_target_modules == ["q_proj", "v_proj"]


def test_overrides_return_a_new_config():
    base = Config()
    config = apply_overrides(base, ["--seed=7"])
    assert config.seed == 7 and base.seed == 42


@pytest.mark.parametrize("text, expected", [
    ("true", True), ("True", True), ("1", True), ("yes", True), ("YES", True),
    ("false", False), ("FALSE", False), ("0", False), ("no", False),
])
def test_bool_spellings(text, expected):
    assert apply_overrides(Config(), [f"--gradient_checkpointing={text}"]).gradient_checkpointing is expected


@pytest.mark.parametrize("arg", ["--save_total_limit=none", "--save_total_limit=None",
                                 "--reward_weights=none", "--epsilon_high=None"])
def test_none_for_optional_fields(arg):
    config = apply_overrides(Config(save_total_limit=2, reward_weights=[1.0], epsilon_high=0.3), [arg])
    key = arg[2:].split("=")[0]
    assert getattr(config, key) is None


@pytest.mark.parametrize("key, text, python, stored", [
    # peft's "all-linear" (every linear layer but the output head); names, as a list or comma-separated text.
    ("lora_target_modules", "all-linear", "all-linear", "all-linear"),
    ("lora_target_modules", "q_proj,v_proj", ("q_proj", "v_proj"), ["q_proj", "v_proj"]),
    # transformers' True: the newest checkpoint in output_dir; False: none.
    ("resume_from_checkpoint", "true", True, True),
    ("resume_from_checkpoint", "False", False, False),
    ("resume_from_checkpoint", "latest", "latest", "latest"),
    ("save_strategy", "no", "no", "no"),
    ("save_strategy", "epoch", "epoch", "epoch"),
])
def test_transformers_and_peft_values_in_python_and_on_the_command_line(key, text, python, stored):
    assert getattr(Config(**{key: python}), key) == stored
    assert getattr(apply_overrides(Config(), [f"--{key}={text}"]), key) == stored


@pytest.mark.parametrize("settings, message", [
    (dict(lora_target_modules=r".*\.q_proj"), 'lora_target_modules must be module names (a list, or '
                                              'comma-separated) or "all-linear" (peft\'s regex strings are not read '
                                              "here), got ['.*\\\\.q_proj']"),
    (dict(save_strategy="best"), "save_strategy must be one of steps, epoch, no, got 'best'"),
    (dict(resume_from_checkpoint=3), 'resume_from_checkpoint must be a checkpoint folder, "latest", or True / '
                                     "False, got 3"),
])
def test_transformers_and_peft_values_we_lack(settings, message):
    with pytest.raises(ConfigError) as error:
        Config(**settings)
    assert str(error.value) == message


def test_later_overrides_win():
    assert apply_overrides(Config(), ["--seed=1", "--seed=2"]).seed == 2


def clip_range(config):
    settings = config.loss_settings()
    return settings["epsilon_low"], settings["epsilon_high"]


def test_epsilon_is_the_lower_bound_and_epsilon_high_defaults_to_it_as_in_trl():
    assert clip_range(Config()) == (0.2, 0.2)
    assert clip_range(Config(epsilon=0.3)) == (0.3, 0.3)
    config = Config(epsilon=0.2, epsilon_high=0.28)
    assert (config.epsilon, config.epsilon_high) == (0.2, 0.28) and clip_range(config) == (0.2, 0.28)
    # On the command line the order does not matter.
    for args in (["--epsilon=0.1", "--epsilon_high=0.28"], ["--epsilon_high=0.28", "--epsilon=0.1"]):
        assert clip_range(apply_overrides(Config(), args)) == (0.1, 0.28)
    # An unset epsilon_high follows a later epsilon; --epsilon_high=none unsets it again.
    assert clip_range(apply_overrides(Config(), ["--epsilon=0.1"])) == (0.1, 0.1)
    unset = apply_overrides(Config(epsilon_high=0.28), ["--epsilon_high=none", "--epsilon=0.3"])
    assert clip_range(unset) == (0.3, 0.3)


def test_trl_defaults():
    # TRL 1.16's GRPOConfig defaults, where Config has the same setting (checked against TRL itself, when
    # installed, by test_trl_settings_list_matches_trl).
    config = Config()
    assert (config.adam_beta1, config.adam_beta2, config.learning_rate, config.gradient_checkpointing) == \
        (0.9, 0.999, 1e-6, True)
    assert (config.max_completion_length, config.num_generations, config.temperature, config.beta) == (512, 8, 1.0, 0.0)
    assert (config.loss_type, config.importance_sampling_level) == ("dapo", "token")
    assert config.use_bias_correction_kl is True
    assert (config.epsilon, config.epsilon_high, config.delta, config.top_entropy_quantile) == (0.2, None, None, 1.0)
    assert (config.mask_truncated_completions, config.scale_rewards, config.num_iterations) == (False, "group", 1)
    assert (config.entropy_coef, config.off_policy_mask_threshold, config.disable_dropout) == (0.0, None, False)
    assert (config.cast_lm_head_to_fp32, config.pad_to_multiple_of, config.sync_ref_model) == (False, None, False)
    assert (config.ref_model_mixup_alpha, config.ref_model_sync_steps, config.use_adaptive_entropy) == (0.6, 512, False)
    assert (config.entropy_coef_min, config.entropy_coef_max, config.entropy_coef_delta, config.entropy_target) == \
        (0.0, 1.0, 0.005, 0.2)


def test_entropy_coef_and_off_policy_mask_reach_the_loss():
    settings = Config(entropy_coef=0.01, off_policy_mask_threshold=0.5).loss_settings()
    assert (settings["entropy_coef"], settings["off_policy_mask_threshold"]) == (0.01, 0.5)
    assert Config(entropy_coef=-1).entropy_coef == -1.0  # an entropy penalty is allowed, as in TRL
    with pytest.raises(ConfigError, match="entropy_coef must be finite"):
        Config(entropy_coef=float("inf"))
    with pytest.raises(ConfigError, match="off_policy_mask_threshold must be >= 0 and finite"):
        Config(off_policy_mask_threshold=-0.1)


@pytest.mark.parametrize("key, message", [
    ("use_transformers_paged", "TRL's `use_transformers_paged` is not supported here: sampling runs on the policy"),
    ("vllm_gpu_memory_utilization", "TRL's `vllm_gpu_memory_utilization` is not supported here: vllm_mode=\"server\" "
                                    "only: set it when you start the server"),
    ("neftune_noise_alpha", "TRL's `neftune_noise_alpha` is not supported here: a supervised-training setting"),
    ("torch_compile", "TRL's `torch_compile` is not supported here: torch.compile is not used"),
    ("accelerator_config", "TRL's `accelerator_config` is not supported here: accelerate is not used"),
    ("loss_aggregation", "'loss_aggregation' is gone: use TRL's loss_type: 'token' is 'dapo'"),
    ("epsilon_low", "'epsilon_low' is gone: use TRL's epsilon"),
    ("eval_batch_size", "'eval_batch_size' is gone: use TRL's per_device_eval_batch_size"),
])
def test_trl_settings_we_lack_get_their_own_error(key, message):
    with pytest.raises(ConfigError) as info:
        apply_overrides(Config(), [f"--{key}=1"])
    assert str(info.value).startswith(message) and "did you mean" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        Config(**{"learning_rate": 1e-5, key: 1})  # from Python (and recipes) too
    assert str(info.value).startswith(message)


def test_a_trl_config_dict_ports_verbatim():
    settings = dict(output_dir="runs/x", learning_rate=1e-6, per_device_train_batch_size=8, num_generations=4,
                    loss_type="dr_grpo", epsilon_high=0.28, mask_truncated_completions=True, beta=0.001,
                    max_completion_length=256, gradient_checkpointing=True, bf16=True, logging_steps=10)
    config = Config(**settings)
    assert all(getattr(config, k) == v for k, v in settings.items())
    assert clip_range(config) == (0.2, 0.28)
    with pytest.raises(ConfigError, match=r"unknown setting 'learning_rat' \(did you mean 'learning_rate'"):
        Config(learning_rat=1e-5)


def test_every_setting_not_accepted_is_named_in_one_error():
    message = ("3 settings are not accepted: unknown setting 'learning_rat' (did you mean "
               "'learning_rate'?); TRL's `use_transformers_paged` is not supported here: sampling runs on the policy "
               "itself (KV-cached decoding in grpo.rollout); TRL's `torch_compile` is not supported here: "
               "torch.compile is not used: the step is eager PyTorch")
    with pytest.raises(ConfigError) as info:
        Config(learning_rat=1e-5, use_transformers_paged=True, torch_compile=True, seed=1)
    assert str(info.value) == message
    with pytest.raises(ConfigError) as info:
        apply_overrides(Config(), ["--seed=1", "--learning_rat=1e-5", "--use_transformers_paged=true",
                                   "--torch_compile"])
    assert str(info.value) == message


@pytest.mark.parametrize("settings, args, warnings", [
    # Any value: nothing here depends on it.
    ({"use_cpu": True, "logging_first_step": True}, ["--use_cpu", "--logging_first_step=true"],
     ["TRL's `use_cpu` has no effect here: the device is chosen automatically: the GPU when there is one "
      "(CUDA_VISIBLE_DEVICES= hides it)",
      "TRL's `logging_first_step` has no effect here: logging_steps sets which steps are logged (every one by "
      "default)"]),
    # A feature this trainer lacks, at the value that leaves it off, as Python or as command-line text.
    ({"use_transformers_paged": False, "gradient_checkpointing_kwargs": {"use_reentrant": False}},
     ["--use_transformers_paged=False", '--gradient_checkpointing_kwargs={"use_reentrant":false}'],
     ["TRL's `use_transformers_paged=false` has no effect here: sampling runs on the policy itself (KV-cached "
      "decoding in grpo.rollout)",
      "TRL's `gradient_checkpointing_kwargs={\"use_reentrant\": false}` has no effect here: checkpointing is "
      "always non-reentrant here"]),
])
def test_trl_settings_that_change_nothing_are_accepted_with_a_warning_each(capsys, settings, args, warnings):
    expected = [f"warning: {w}" for w in warnings]
    assert Config(seed=3, **settings) == Config(seed=3)
    assert capsys.readouterr().err.splitlines() == expected
    assert apply_overrides(Config(), ["--seed=3", *args]) == Config(seed=3)
    assert capsys.readouterr().err.splitlines() == expected


def test_warmup_steps_is_transformers_5s():
    from grpo.policy.optim import warmup_of

    assert Config(warmup_steps=3).warmup_steps == 3.0 and apply_overrides(Config(), ["--warmup_steps=0.1"])
    # (total steps, warmup_ratio, warmup_steps) -> warmup steps: whole steps, a fraction rounded up, or the
    # ratio's: 3; 0.05 x 100 = 5; 0.05 x 30 = 1.5 -> 2; 0.1 x 30 = 3; none.
    cases = [(100, 0, 3), (100, 0, 0.05), (30, 0, 0.05), (30, 0.1, 0), (30, 0, 0)]
    assert [warmup_of(*case) for case in cases] == [3, 5, 2, 3, 0]
    with pytest.raises(ConfigError, match=r"set warmup_steps or warmup_ratio, not both \(got 2 and 0.1\)"):
        Config(warmup_steps=2, warmup_ratio=0.1)
    with pytest.raises(ConfigError, match="warmup_steps must be >= 0: whole steps, or a fraction < 1, got "):
        Config(warmup_steps=2.5)


def test_trl_settings_accepted_at_off_values_are_trls_defaults():
    trl = pytest.importorskip("trl")
    from grpo.settings.trl_names import NO_EFFECT, OFF_VALUES, TRL_ONLY

    assert set(NO_EFFECT) | set(OFF_VALUES) <= TRL_ONLY
    args = trl.GRPOConfig(output_dir="unused", use_cpu=True)
    assert {k: getattr(args, k) for k in OFF_VALUES if getattr(args, k) not in OFF_VALUES[k]} == {}


def test_scale_rewards_takes_trls_bools():
    assert (Config(scale_rewards=True).scale_rewards, Config(scale_rewards=False).scale_rewards) == ("group", "none")
    with pytest.raises(ConfigError, match="scale_rewards must be one of group, batch, none"):
        Config(scale_rewards="std")


def test_eval_strategy_and_eval_steps_take_transformers_values():
    assert (Config().eval_strategy, Config().eval_steps) == ("no", None)  # transformers' defaults
    with pytest.raises(ConfigError, match="eval_strategy must be one of no, steps, epoch, got 'best'"):
        Config(eval_strategy="best")
    with pytest.raises(ConfigError, match="eval_steps must be >= 1, or None for logging_steps"):
        Config(eval_strategy="steps", eval_steps=0)  # 0 used to mean "never" here: refused, not read as None


def test_the_cadence_logs_evaluates_and_saves_as_transformers_default_flow_does():
    from grpo.settings.plan import Cadence

    # 7 steps, a pass over the prompts ending with step 4: (log, evaluate, save) after each.
    epoch = Cadence.of(Config(logging_steps=3, eval_strategy="epoch", save_strategy="steps", save_steps=5))
    assert [epoch.due(s, 7, epoch_ended=s == 4) for s in range(1, 8)] == [
        (False, False, False), (False, False, False), (True, False, False), (False, True, False),
        (False, False, True), (True, False, False), (True, True, True)]
    steps = Cadence.of(Config(logging_steps=2, eval_strategy="steps", save_strategy="epoch"))  # eval every 2
    assert [steps.due(s, 3, epoch_ended=s == 1)[1:] for s in range(1, 4)] == [(False, True), (True, False),
                                                                               (True, True)]
    never = Cadence.of(Config(eval_strategy="no", eval_steps=1, save_strategy="no"))
    assert [never.due(s, 2, epoch_ended=True)[1:] for s in (1, 2)] == [(False, False)] * 2


def test_trl_settings_list_matches_trl():
    trl = pytest.importorskip("trl")
    from grpo.settings.trl_names import RENAMED, TRL_ONLY, TRL_REASONS

    ours = {f.name for f in dataclasses.fields(Config)}
    theirs = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    assert TRL_ONLY == theirs - ours  # exactly TRL's settings we lack (TRL 1.16 with this transformers)
    assert set(TRL_REASONS) <= TRL_ONLY and not set(RENAMED) & (ours | theirs)
    # Every one of them is accepted with a warning saying why it changes nothing, or refused saying why.
    from grpo.settings.trl_names import NO_EFFECT

    assert not TRL_ONLY - set(TRL_REASONS) - set(NO_EFFECT), "say why each TRL setting is refused"
    # Their defaults are ours but where a comment beside the field says why not.
    args, config = trl.GRPOConfig(output_dir="unused", use_cpu=True), Config()
    differ = {k for k in ours & theirs if getattr(args, k) != getattr(config, k)}
    assert differ == {"output_dir", "num_train_epochs", "optim", "logging_steps", "fsdp", "bf16",
                      "report_to", "steps_per_generation", "generation_batch_size", "per_device_eval_batch_size"}
    # TRL resolves those two in __post_init__ (it knows the rank count); the Trainer resolves our Nones alike.
    from grpo.settings.schedule import Schedule

    schedule = Schedule.resolve(config, world_size=1)
    assert (schedule.micro_batches_per_generation, schedule.completions_per_generation) == (
        args.steps_per_generation, args.generation_batch_size)


@pytest.mark.parametrize("arg, message", [
    ("--learning_rate=abc", "--learning_rate: expected a float, got 'abc'"),
    ("--num_generations=1.5", "--num_generations: expected an integer, got '1.5'"),
    ("--num_generations=", "--num_generations: expected an integer, got ''"),
    ("--bf16=maybe", "--bf16: expected a boolean (true/false) or none, got 'maybe'"),
    ("--save_total_limit=all", "--save_total_limit: expected an integer or none, got 'all'"),
    ("--reward_weights=1,x", "--reward_weights: expected a comma-separated list of floats or none, got '1,x'"),
    ("--learning_rate", "--learning_rate needs a value: --learning_rate=VALUE"),
    ("learning_rate=1", "expected --key=value, got 'learning_rate=1'"),
    ("--", "expected --key=value, got '--'"),
])
def test_bad_values(arg, message):
    with pytest.raises(ConfigError) as info:
        apply_overrides(Config(), [arg])
    assert str(info.value) == message


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError) as info:
        apply_overrides(Config(), ["--learning_rat=1e-5"])
    assert str(info.value) == "unknown setting 'learning_rat' (did you mean 'learning_rate'?)"
    with pytest.raises(ConfigError, match=r"unknown setting 'zzzzzz' \(see --help"):
        apply_overrides(Config(), ["--zzzzzz=1"])


def test_dashes_in_keys_are_accepted():
    assert apply_overrides(Config(), ["--max-steps=5"]).max_steps == 5


# --- sampling settings: TRL's min_p, repetition_penalty, generation_kwargs, chat_template_kwargs ----------------


def test_generation_kwargs_override_the_sampling_fields():
    config = Config(temperature=0.9, top_k=0, min_p=0.05,
                    generation_kwargs={"top_k": 5, "min_p": None, "do_sample": True})
    defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0}
    assert dataclasses.asdict(config.sampling_knobs()) == {**defaults, "temperature": 0.9, "top_k": 5}
    assert (config.top_k, config.min_p) == (0, 0.05), "the fields themselves keep their values"
    assert dataclasses.asdict(Config().sampling_knobs()) == defaults
    # As in TRL: JSON text is accepted from Python too, and ints become floats where the field is a float.
    assert Config(generation_kwargs='{"repetition_penalty": 2}').sampling_knobs().repetition_penalty == 2.0


UNSUPPORTED = ("its own loop, not model.generate, and takes temperature, top_p, top_k, min_p, repetition_penalty "
               "(and do_sample=true)")


@pytest.mark.parametrize("settings, message", [
    ({"min_p": 1.5}, "min_p must be in [0, 1], or None to disable it, got 1.5"),
    ({"repetition_penalty": 0}, "repetition_penalty must be > 0 (1.0 disables it), got 0.0"),
    ({"generation_kwargs": {"num_beams": 4}}, "generation_kwargs['num_beams'] is not supported: sampling here is "
                                              + UNSUPPORTED),
    ({"generation_kwargs": {"max_new_tokens": 4}},
     "generation_kwargs['max_new_tokens'] is not supported (set max_completion_length instead)"),
    ({"generation_kwargs": {"do_sample": False}}, "generation_kwargs['do_sample'] must be true, got False"),
    ({"generation_kwargs": {"top_k": -1}}, "generation_kwargs['top_k'] must be >= 0 (0 disables it), got -1"),
    ({"generation_kwargs": {"top_p": "0.9"}}, "generation_kwargs['top_p'] must be a float, got str '0.9'"),
    ({"generation_kwargs": "top_k=5"}, """generation_kwargs must be a JSON object such as '{"key": 1}', got"""),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs must be a dict with string keys"),
    ({"chat_template_kwargs": {"x": {1, 2}}}, "chat_template_kwargs must hold JSON data (it is saved with the run)"),
])
def test_bad_sampling_settings(settings, message):
    with pytest.raises(ConfigError) as info:
        Config(**settings)
    assert str(info.value).startswith(message)


def test_dict_settings_from_the_command_line():
    config = apply_overrides(Config(), ['--generation_kwargs={"top_k": 5, "temperature": 0.7}',
                                        '--chat_template_kwargs={"enable_thinking": false}', "--min_p=0.1",
                                        "--repetition_penalty=1.1"])
    assert config.generation_kwargs == {"top_k": 5, "temperature": 0.7}
    assert config.chat_template_kwargs == {"enable_thinking": False}
    assert (config.min_p, config.repetition_penalty) == (0.1, 1.1)
    assert apply_overrides(config, ["--generation_kwargs=none"]).generation_kwargs is None
    with pytest.raises(ConfigError) as info:
        apply_overrides(Config(), ["--generation_kwargs=top_k=5"])
    assert str(info.value) == ("--generation_kwargs: expected a JSON object (such as {\"top_k\": 5}) or none, "
                               "got 'top_k=5'")
    with pytest.raises(ConfigError) as info:
        apply_overrides(Config(), ['--generation_kwargs={"beams": 2}'])
    assert str(info.value).startswith("""--generation_kwargs={"beams": 2}: generation_kwargs['beams'] is not""")


# --- help and serialisation ----------------------------------------------------------------------


def help_entries(text: str) -> dict[str, tuple[str, str]]:
    """--help's settings: {name: (value as shown, the description under it)}, in the order shown."""
    entries, name = {}, None
    for line in text.splitlines():
        if line.startswith("  --"):
            name, _, value = line.strip()[2:].partition("=")
            entries[name] = (value, "")
        elif line.startswith("      ") and name is not None:
            value, doc = entries[name]
            entries[name] = (value, f"{doc} {line.strip()}".strip())
    return entries


def test_every_field_has_a_docstring_and_appears_in_help():
    text = format_help(Config(reward_weights=[1.0, 0.5]))
    entries = help_entries(text)
    assert list(entries) == [f.name for f in dataclasses.fields(Config)]  # declaration order
    undocumented = [name for name, (_, doc) in entries.items() if not doc]
    assert not undocumented, f"Config fields without a docstring: {undocumented}"
    assert entries["seed"] == ("42", "Seed for data order, sampling and initialisation.")
    assert entries["reward_weights"][0] == "1.0,0.5" and entries["save_total_limit"][0] == "none"
    assert entries["use_lora"][1].startswith("Train LoRA adapters instead of all weights;")
    # Under their `# --- group ---` headings.
    order = ["\nmodel:\n", "--model=", "\noptimisation:\n", "--learning_rate=",
             "\nlogging and checkpoints:\n", "--save_steps="]
    assert [text.index(part) for part in order] == sorted(text.index(part) for part in order)


def test_help_values_round_trip_through_overrides():
    config = Config(reward_weights=[1.0, 0.5], lora_target_modules=["q_proj"], use_lora=True,
                    generation_kwargs={"top_k": 5}, chat_template_kwargs={"enable_thinking": False, "note": "a b"})
    assert '--generation_kwargs={"top_k": 5}' in format_help(config)
    args = [line.strip() for line in format_help(config).splitlines() if line.startswith("  --")]
    assert apply_overrides(Config(), args) == config


def test_a_config_saved_as_json_reads_back_the_same():
    config = Config(reward_weights=[1, 2.0], generation_kwargs='{"top_k": 5}', report_to=["tensorboard"],
                    optim="adamw_torch", scale_rewards=False)
    data = json.loads(json.dumps(dataclasses.asdict(config)))  # as runs save it (grpo_config.json, trackers)
    assert set(data) == {f.name for f in dataclasses.fields(Config)}
    assert (data["reward_weights"], data["generation_kwargs"]) == ([1.0, 2.0], {"top_k": 5})
    assert (data["optim"], data["scale_rewards"]) == ("adamw", "none")  # stored as ours
    assert Config(**data) == config


# --- recipes -------------------------------------------------------------------------------------


def write(path, source):
    path.write_text(textwrap.dedent(source))
    return str(path)


GOOD_RECIPE = """
    from datasets import Dataset
    from grpo.settings import Config
    from helper import double  # a sibling file

    config = Config(learning_rate=2e-6, num_generations=4)

    def length_reward(completions, **kwargs):
        return [double(len(c)) for c in completions]

    reward_funcs = [length_reward]
    train_dataset = Dataset.from_dict({"prompt": ["a", "b"], "answer": ["1", "2"]})

    def eval_dataset():
        return Dataset.from_dict({"prompt": ["c"], "answer": ["3"]})
"""


def test_load_recipe(tmp_path):
    write(tmp_path / "helper.py", "def double(x):\n    return 2.0 * x\n")
    path = write(tmp_path / "recipe.py", GOOD_RECIPE)
    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe) and recipe.path == path
    assert recipe.config.learning_rate == 2e-6
    assert recipe.reward_funcs[0](completions=["abc"]) == [6.0]
    assert len(resolve_dataset(recipe.train_dataset)) == 2
    assert callable(recipe.eval_dataset)  # left unresolved until needed
    assert resolve_dataset(recipe.eval_dataset)["answer"] == ["3"]
    assert str(tmp_path) not in sys.path  # the folder is only on sys.path while importing


def test_load_recipe_minimal(tmp_path):
    path = write(tmp_path / "r.py", """
        from grpo.settings import Config
        config = Config()
        reward_funcs = lambda completions, **kw: [0.0] * len(completions)  # a single function
        train_dataset = lambda: None
    """)
    recipe = load_recipe(path)
    assert len(recipe.reward_funcs) == 1 and recipe.eval_dataset is None
    with pytest.raises(ConfigError, match="must be a datasets.Dataset, got NoneType"):
        resolve_dataset(recipe.train_dataset, "train_dataset")
    assert resolve_dataset(None) is None


def test_two_recipes_do_not_clash(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    body = "from grpo.settings import Config\nconfig = Config(seed={})\nreward_funcs = [len]\ntrain_dataset = dict\n"
    a = load_recipe(write(tmp_path / "a" / "recipe.py", body.format(1)))
    b = load_recipe(write(tmp_path / "b" / "recipe.py", body.format(2)))
    assert (a.config.seed, b.config.seed) == (1, 2)


def test_recipe_not_found(tmp_path):
    missing = str(tmp_path / "nope.py")
    with pytest.raises(ConfigError) as info:
        load_recipe(missing)
    assert str(info.value) == f"recipe not found: {missing}"


@pytest.mark.parametrize("source, message", [
    ("x = 1\n", "does not define config, reward_funcs, train_dataset: a recipe must define `config`"),
    ("from grpo.settings import Config\nconfig = Config()\ntrain_dataset = dict\n",
     "does not define reward_funcs: a recipe must define"),
    ("config = {'learning_rate': 1e-6}\nreward_funcs = [len]\ntrain_dataset = dict\n",
     "defines `config` as dict {'learning_rate': 1e-06}, not a grpo.Config"),
    ("config = 5\n", "does not define reward_funcs, train_dataset and defines `config` as int 5, not a grpo.Config "
                     "\\(write config = Config\\(...\\)\\)"),
    ("from grpo.settings import Config\nconfig = Config()\nreward_funcs = []\ntrain_dataset = dict\n",
     "`reward_funcs` must be a non-empty list of functions"),
    ("from grpo.settings import Config\nconfig = Config()\nreward_funcs = [len, 'oops']\ntrain_dataset = dict\n",
     "reward_funcs\\[1\\] is not callable: 'oops'"),
    ("from grpo.settings import Config\nconfig = Config()\nreward_funcs = [len]\ntrain_dataset = [{'prompt': 'a'}]\n",
     "`train_dataset` must be a datasets.Dataset or a function returning one, got list"),
    ("from grpo.settings import Config\nconfig = Config()\nreward_funcs = [len]\ntrain_dataset = dict\n"
     "eval_dataset = 'data.json'\n",
     "`eval_dataset` must be a datasets.Dataset or a function returning one, got str"),
    ("config = (\n", "r.py:1: syntax error"),
])
def test_recipe_errors(tmp_path, source, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe(write(tmp_path / "r.py", source))


def test_recipe_not_python(tmp_path):
    with pytest.raises(ConfigError, match="not a Python file"):
        load_recipe(write(tmp_path / "recipe.txt", "config = 1\n"))


def test_recipe_runtime_error_keeps_its_traceback(tmp_path):
    with pytest.raises(ZeroDivisionError):
        load_recipe(write(tmp_path / "r.py", "x = 1 / 0\n"))


# --- checks of values, on every Config made (recipe, override or Python) ---------------------------


@pytest.mark.parametrize("settings, message", [
    (dict(num_generations=1), "num_generations must be >= 2: GRPO scores each completion against the others of "
                              "its prompt, so a group of one has no signal, got 1"),
    (dict(max_completion_length=0), "max_completion_length must be >= 1, got 0"),
    (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps must be >= 1, got 0"),
    (dict(max_steps=0), "max_steps must be > 0, or -1 to train for num_train_epochs, got 0"),
    (dict(save_steps=0), "save_steps must be >= 1, got 0"),
    (dict(save_total_limit=0), "save_total_limit must be >= 1, or None to keep every checkpoint, got 0"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(epsilon=1.5), "epsilon must be in [0, 1), got 1.5"),
    (dict(loss_type="token"),
     "loss_type must be one of dapo, grpo, bnpo, dr_grpo, cispo, sapo, luspo, vespo, got 'token'"),
    (dict(importance_sampling_level="seq"), "importance_sampling_level must be one of token, sequence, got 'seq'"),
    (dict(top_entropy_quantile=1.5), "top_entropy_quantile must be in [0, 1], got 1.5"),
    (dict(delta=0), "delta must be > 0, or None for one-sided clipping, got 0.0"),
    (dict(lr_scheduler_type="reduce_lr_on_plateau"),
     "lr_scheduler_type must be one of linear, cosine, cosine_with_restarts, polynomial, constant, "
     "constant_with_warmup, inverse_sqrt, cosine_with_min_lr, cosine_warmup_with_min_lr, warmup_stable_decay, "
     "got 'reduce_lr_on_plateau'"),
    (dict(scale_rewards="std"), "scale_rewards must be one of group, batch, none, got 'std'"),
    (dict(num_generations="4"), "num_generations must be an int, got str '4'"),
    (dict(max_steps=True), "max_steps must be an int, got bool True"),
    (dict(use_lora="yes"), "use_lora must be a bool, got str 'yes'"),
    (dict(reward_weights=1.0), "reward_weights must be a list of floats, got 1.0"),
    (dict(reward_weights=[1.0, "x"]), "reward_weights[1] must be a float, got str 'x'"),
    (dict(reward_weights=[1.0, math.inf]), "reward_weights must be finite numbers, got [1.0, inf]"),
    (dict(resume_from_checkpoint=""),
     "resume_from_checkpoint must be a checkpoint folder, \"latest\", or True / False, got ''"),
])
def test_bad_settings_are_refused_with_one_sentence(settings, message):
    with pytest.raises(ConfigError) as info:
        Config(**settings)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)  # for code that catches the usual type


def test_ints_given_for_floats_become_floats():
    config = Config(learning_rate=1, reward_weights=[1, 2], epsilon=0, epsilon_high=1)
    assert type(config.learning_rate) is float and config.reward_weights == [1.0, 2.0]
    assert type(config.reward_weights[0]) is float and type(config.epsilon_high) is float


def test_choice_lists_are_shared_and_checking_a_config_needs_no_torch():
    import subprocess
    import sys

    from grpo import algo
    from grpo.policy import optim
    from grpo.run import trackers
    from grpo.settings import checks, choices

    # One list each, in settings (or algo for the math's), read by the checks and by the code that implements it.
    assert checks.OPTIMIZERS is choices.OPTIMIZERS is optim.OPTIMIZERS and checks.SCHEDULES is optim.SCHEDULES
    assert tuple(trackers.TRACKER_CLASSES) == choices.TRACKERS
    assert checks.SCALES is algo.SCALES and checks.LOSS_TYPES is algo.LOSS_TYPES
    assert set(checks.RULES) <= {f.name for f in dataclasses.fields(Config)}
    code = "import sys, grpo.settings; grpo.settings.Config(optim='adamw'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# --- settings that must agree, checked wherever a Config is made: train, eval and plan refuse alike ---------

QLORA_WITHOUT_LORA = ("load_in_4bit=True needs use_lora=True: 4-bit weights are frozen, QLoRA trains LoRA "
                      "adapters on top of them")
BF16_WEIGHTS_NOT_FULL = ("bf16_weights=True is for full fine-tuning without FSDP: set use_lora=false and "
                         "fsdp=false (LoRA keeps a bf16 base on CUDA already; FSDP keeps float32 shards)")

# The batch schedule's (settings/schedule.py), resolved when a Config is made.
SPLIT_STEPS = ("steps_per_generation=3 must be a multiple of gradient_accumulation_steps=2 here: a generation batch "
               "feeds whole optimizer steps")
SPLIT_GROUPS = ("a generation batch of 6 completions per rank (per_device_train_batch_size x steps_per_generation) "
                "must hold whole groups of num_generations=8")


@pytest.mark.parametrize("settings, message", [
    (dict(load_in_4bit=True), QLORA_WITHOUT_LORA),
    (dict(bf16_weights=True, use_lora=True), BF16_WEIGHTS_NOT_FULL),
    (dict(bf16_weights=True, fsdp=True), BF16_WEIGHTS_NOT_FULL),
    (dict(steps_per_generation=3, gradient_accumulation_steps=2), SPLIT_STEPS),
    (dict(per_device_train_batch_size=6), SPLIT_GROUPS),
], ids=["4bit-without-lora", "bf16-weights-with-lora", "bf16-weights-with-fsdp", "split-steps", "split-groups"])
def test_settings_that_cannot_work_together_are_refused_wherever_a_config_is_made(tmp_path, settings,
                                                                                   message):
    args = [f"--{k}={format_value(v)}" for k, v in settings.items()]
    made = {
        "Python": lambda: Config(**settings),
        "replace": lambda: dataclasses.replace(Config(), **settings),
        "overrides": lambda: apply_overrides(Config(), args),
        "recipe": lambda: load_recipe(write(tmp_path / "r.py", f"""
            from grpo.settings import Config
            config = Config(**{settings!r})
            reward_funcs = [len]
            train_dataset = dict
        """)),
    }
    for where, make in made.items():
        with pytest.raises(ConfigError) as info:
            make()
        expected = f"{tmp_path / 'r.py'}:3: {message}" if where == "recipe" else message
        assert str(info.value) == expected, where


def test_overrides_that_must_agree_are_checked_together_in_any_order():
    for args in (["--load_in_4bit=true", "--use_lora"], ["--use_lora", "--load_in_4bit=true"]):
        config = apply_overrides(Config(), args)
        assert config.load_in_4bit and config.use_lora
    qlora = Config(use_lora=True, load_in_4bit=True)
    assert not apply_overrides(qlora, ["--use_lora=false", "--load_in_4bit=false"]).use_lora
    assert Config(bf16_weights=True).bf16_weights and Config(use_lora=True, fsdp=True).fsdp  # each alone
    with pytest.raises(ConfigError) as info:  # a value's own error still names its override
        apply_overrides(Config(), ["--use_lora", "--load_in_4bit=true", "--lora_r=0"])
    assert str(info.value) == "--lora_r=0: lora_r must be >= 1, got 0"


def test_the_schedule_is_checked_on_the_ranks_torchrun_announces(monkeypatch):
    settings = dict(per_device_train_batch_size=4, num_generations=4, generation_batch_size=4)
    assert Config(**settings).generation_batch_size == 4  # one process: one micro-batch per generation batch
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="generation_batch_size=4 must be a multiple of per_device_train_batch_size "
                                          "x ranks = 8"):
        Config(**settings)


@pytest.mark.parametrize("settings, old, reference", [
    (dict(), False, "none"),
    (dict(num_iterations=2), True, "none"),
    (dict(steps_per_generation=2, beta=0.04), True, "copy"),
    (dict(use_lora=True, beta=0.04), False, "adapter"),
])
def test_the_run_plan_says_which_log_probs_a_generation_batch_keeps(settings, old, reference):
    from grpo.settings.plan import RunPlan

    plan = RunPlan.resolve(Config(per_device_train_batch_size=8, num_generations=4, **settings), world_size=1)
    g = plan.generation
    assert (g.old_logprobs, plan.logprobs.reference, g.ref_logprobs) == (old, reference, reference != "none")
    assert dict(plan.loss) == Config(**settings).loss_settings()


def test_the_docs_name_every_default_that_differs_from_trls():
    # README and docs/coming-from-trl.md promise TRL's default for every setting but those they name: the names
    # must be exactly the settings whose default differs (checked against TRL itself when it is installed).
    root = Path(__file__).resolve().parents[2]
    intro = (root / "docs" / "coming-from-trl.md").read_text().split("TRL reward functions")[0]
    readme = (root / "README.md").read_text().split("**TRL-compatible.**")[1].split("reward functions")[0]
    named = set(re.findall(r"`(\w+)=", intro))
    assert named == {"optim", "num_train_epochs", "logging_steps", "max_prompt_length", "per_device_eval_batch_size",
                     "bf16"}, named
    assert all(f"`{name}`" in readme for name in named) and "six" in readme
    trl = pytest.importorskip("trl")
    args, config = trl.GRPOConfig(output_dir="unused", use_cpu=True), Config()
    differ = {k for k in {f.name for f in dataclasses.fields(Config)} & {f.name for f in dataclasses.fields(
        trl.GRPOConfig)} if getattr(args, k) != getattr(config, k)}
    # output_dir is the run's; report_to's "none" and fsdp's switch are TRL's values in another form; the
    # generation batch's two are resolved alike (test_trl_settings_list_matches_trl); max_prompt_length is not TRL's
    assert differ - {"output_dir", "report_to", "fsdp", "steps_per_generation", "generation_batch_size"} == \
        named - {"max_prompt_length"}
