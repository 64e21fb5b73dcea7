"""The one `Config` of a run. Field names follow TRL's `GRPOConfig` wherever the concept exists there,
so settings written for TRL carry over unchanged."""
from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import re
import textwrap
import types
import typing
from dataclasses import dataclass

from .algo import LOGPROB_CHUNK_SIZE
from .config_checks import check_config
from .errors import ConfigError


@dataclass
class Config:
    # --- model ---
    model: str = "Qwen/Qwen2.5-0.5B-Instruct"
    """Hub id or local path of the policy model (ignored when a model is passed to `Trainer`)."""
    output_dir: str = "runs/grpo"
    """Where metrics.jsonl, completions.jsonl and checkpoint-STEP/ folders are written."""
    bf16: bool = True
    """Train in bfloat16 autocast on CUDA; CPU always runs float32."""
    bf16_weights: bool = False
    """Full fine-tuning keeps bf16 weights and gradients (half of float32's memory, CUDA or CPU); each update is
    computed in float32 and written back with stochastic rounding, so updates far below bf16's precision still
    add up on average. Not TRL's (it has no such option); needs use_lora=false."""

    # --- optimisation ---
    learning_rate: float = 1e-6
    """Peak learning rate of the optimizer."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.99
    """AdamW beta2."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    lr_scheduler_type: str = "linear"
    """Learning-rate schedule after warmup: "cosine", "linear" or "constant"."""
    warmup_ratio: float = 0.0
    """Fraction of the optimizer steps spent warming the learning rate up linearly from 0."""
    optim: str = "adamw_8bit"
    """Optimizer: "adamw_8bit" (bitsandbytes, 4x smaller state) or "adamw" (torch)."""
    max_nonfinite_steps: int = 3
    """Stop after this many optimizer steps in a row with a NaN/inf loss or gradient norm (each is skipped)."""

    # --- batch and schedule ---
    per_device_train_batch_size: int = 1
    """Prompts per micro-batch on each rank; each prompt is expanded to `num_generations` completions."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (prompts per step = this x per_device_train_batch_size x ranks)."""
    num_generations: int = 8
    """Completions sampled per prompt (the group size G of GRPO)."""
    num_train_epochs: float = 1.0
    """Passes over the training prompts (ignored when max_steps > 0)."""
    max_steps: int = -1
    """Number of optimizer steps; when > 0 it overrides num_train_epochs."""
    seed: int = 42
    """Seed for data order, sampling and initialisation."""

    # --- sampling ---
    max_prompt_length: int = 512
    """Prompts longer than this (in tokens) are cut from the left, with a one-time warning."""
    max_completion_length: int = 256
    """Most tokens generated per completion."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are computed at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 disables it)."""
    top_k: int = 0
    """Sample only from the k most likely tokens (0 disables it)."""
    stop_at_eos: bool = True
    """End completions at EOS; False always samples max_completion_length tokens (benchmarks: equal work)."""

    # --- algorithm ---
    beta: float = 0.0
    """Weight of the k3 KL penalty to the reference model (0: no reference model, no reference forward)."""
    epsilon_low: float = 0.2
    """Lower clip range: the ratio is clipped at 1 - epsilon_low."""
    epsilon_high: float = 0.2
    """Upper clip range: the ratio is clipped at 1 + epsilon_high (DAPO's clip-higher uses e.g. 0.28)."""
    epsilon: float | None = None
    """Symmetric clip range: when set, it sets both epsilon_low and epsilon_high."""
    num_iterations: int = 1
    """Optimizer passes over each generation batch (mu in the GRPO paper)."""
    scale_rewards: str = "group"
    """Advantage scaling: "group" std, "batch" std, or "none" (Dr. GRPO)."""
    loss_aggregation: str = "token"
    """Loss aggregation: "token" (DAPO), "sequence" (GRPO) or "constant" (Dr. GRPO)."""
    reward_weights: list[float] | None = None
    """One weight per reward function (default: all 1.0)."""

    # --- memory ---
    use_lora: bool = False
    """Train LoRA adapters instead of all weights; the reference is the base model with adapters disabled."""
    lora_r: int = 16
    """LoRA rank."""
    lora_alpha: int = 32
    """LoRA scaling numerator (scale = lora_alpha / lora_r)."""
    lora_dropout: float = 0.05
    """Dropout on the LoRA input."""
    lora_target_modules: list[str] | None = None
    """Module names to adapt (default: every linear layer except the LM head)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward instead of storing them."""
    logprob_chunk_size: int = LOGPROB_CHUNK_SIZE
    """Token rows per chunk of LM-head logits when computing log-probs (bounds logits memory)."""
    load_in_4bit: bool = False
    """QLoRA: load `model` as 4-bit NF4 (bitsandbytes) under LoRA; applies when the trainer loads `model` itself."""

    # --- logging and checkpoints ---
    logging_steps: int = 1
    """Write a metrics.jsonl line (and completions.jsonl rows) every this many optimizer steps."""
    save_steps: int = 500
    """Save a checkpoint every this many optimizer steps (and always at the end)."""
    save_total_limit: int | None = None
    """Keep at most this many checkpoints, deleting the oldest (None keeps all)."""
    resume_from_checkpoint: str | None = None
    """Continue from this checkpoint folder, or "latest" (the newest complete one in output_dir, if any)."""

    # --- multi-GPU (torchrun) ---
    fsdp: bool = False
    """Under torchrun: shard weights, gradients and optimizer state over ranks (FSDP2), not replicate (DDP)."""

    # --- evaluation ---
    eval_steps: int = 0
    """Greedy pass@1 on the eval dataset every this many optimizer steps and at the end (0: never)."""
    eval_on_start: bool = False
    """Also evaluate before the first GRPO step (step 0), so one run's metrics show GRPO's own gain."""
    eval_limit: int | None = None
    """Evaluate on the first this many eval prompts only (None: all of them)."""
    eval_batch_size: int = 64
    """Prompts per batch of greedy eval generation."""
    eval_accuracy_func: str = "answer_accuracy_reward"
    """Reward function (by name) whose full marks (>= 1.0) count an eval completion as correct."""
    eval_format_func: str | None = "xml_format_reward"
    """Reward function (by name) whose full marks count an eval completion as well-formatted (None: skip)."""

    def __post_init__(self):
        check_config(self)
        if self.epsilon is not None:
            # Fold the symmetric form into the two bounds, then forget it, so that a later
            # `--epsilon_high=` override is not undone by a stale `epsilon`.
            self.epsilon_low = self.epsilon_high = self.epsilon
            self.epsilon = None


# ---------------------------------------------------------------------------------------------------
# Turning `--key=value` flags into a Config, and a Config back into text (recipe files: recipe.py).


def apply_overrides(config: Config, args: list[str]) -> Config:
    """Apply `--key=value` command-line overrides (a bare `--flag` sets a bool field to True).
    Each one is applied in turn, so later ones win and `epsilon` folding happens in order."""
    hints = typing.get_type_hints(Config)
    names = [f.name for f in dataclasses.fields(Config)]
    for arg in args:
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"expected --key=value, got {arg!r}")
        key, has_value, text = arg[2:].partition("=")
        key = key.replace("-", "_")
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else " (see --help for the settings)"
            raise ConfigError(f"unknown setting '{key}'{hint}")
        if not has_value:
            if hints[key] is not bool:
                raise ConfigError(f"--{key} needs a value: --{key}=VALUE")
            text = "true"
        value = parse_value(key, text, hints[key])
        try:
            config = dataclasses.replace(config, **{key: value})
        except (TypeError, ValueError) as e:  # raised by Config.__post_init__ checks
            raise ConfigError(f"--{key}={text}: {e}") from None
    return config


_SCALARS = {int: ("an integer", "integers"), float: ("a float", "floats"),
            bool: ("a boolean (true/false)", "booleans"), str: ("a string", "strings")}
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def parse_value(key: str, text: str, tp):
    """Parse the text of `--key=text` into a value of type `tp` (a field's annotation)."""
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    optional = union and type(None) in typing.get_args(tp)
    if optional:
        if text.strip().lower() == "none":
            return None
        (tp,) = [t for t in typing.get_args(tp) if t is not type(None)]
    is_list = typing.get_origin(tp) is list
    item = typing.get_args(tp)[0] if is_list else tp
    if item not in _SCALARS:
        raise ConfigError(f"--{key}: a setting of type {tp} cannot be set from the command line")
    try:
        if is_list:
            return [_parse_scalar(part, item) for part in text.split(",")] if text.strip() else []
        return _parse_scalar(text, item)
    except ValueError:
        single, plural = _SCALARS[item]
        expected = f"a comma-separated list of {plural}" if is_list else single
        expected += " or none" if optional else ""
        raise ConfigError(f"--{key}: expected {expected}, got {text!r}") from None


def _parse_scalar(text: str, tp):
    """int, float, bool or str from text; ValueError if it does not parse."""
    text = text.strip() if tp is not str else text
    if tp is bool:
        if text.lower() not in _BOOLS:
            raise ValueError(text)
        return _BOOLS[text.lower()]
    return tp(text)  # int("1.5") and float("abc") raise ValueError


def field_docs() -> dict[str, str]:
    """Each Config field's docstring: the string literal right after the field in the class body."""
    return {name: doc for name, _, doc in _describe_fields()}


def _describe_fields() -> list[tuple[str, str, str]]:
    """(name, group, docstring) of each Config field in declaration order; the group is the
    `# --- group ---` comment above it. Read from the source, since Python keeps neither."""
    source = inspect.getsource(Config)
    headings = [(n, m.group(1)) for n, line in enumerate(source.splitlines(), 1)
                if (m := re.fullmatch(r"#\s*---\s*(.*?)\s*---", line.strip()))]
    body = ast.parse(source).body[0].body
    described = []
    for stmt, after in zip(body, body[1:] + [None]):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        groups = [name for lineno, name in headings if lineno < stmt.lineno]
        is_doc = (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                  and isinstance(after.value.value, str))
        doc = inspect.cleandoc(after.value.value) if is_doc else ""
        described.append((stmt.target.id, groups[-1] if groups else "", doc))
    return described


def format_value(value) -> str:
    """A value as it would be written on the command line (`--key=<this>`)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def format_help(config: Config) -> str:
    """Every setting with its current value and docstring, grouped as declared in Config."""
    lines, group = ["settings (override with --key=value):"], None
    for name, field_group, doc in _describe_fields():
        if field_group != group:
            group = field_group
            lines += ["", f"{group}:"]
        lines.append(f"  --{name}={format_value(getattr(config, name))}")
        lines.append(textwrap.fill(doc, width=100, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


def config_to_dict(config: Config) -> dict:
    """The config as plain JSON-serialisable data (for saving next to a run)."""
    return dataclasses.asdict(config)
