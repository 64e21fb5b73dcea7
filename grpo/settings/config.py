"""The one `Config` of a run. Field names follow TRL's `GRPOConfig` wherever the concept exists there,
so settings written for TRL carry over unchanged."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..algo import LOGPROB_CHUNK_SIZE
from .checks import check_config
from .components import SamplingKnobs
from .trl_names import CheckedKeywords


@dataclass
class Config(metaclass=CheckedKeywords):
    # --- model ---
    model: str = "Qwen/Qwen2.5-0.5B-Instruct"
    """Hub id or local path of the policy model (ignored when a model is passed to `Trainer`)."""
    output_dir: str = "runs/grpo"
    """Where metrics.jsonl, completions.jsonl and checkpoint-STEP/ folders are written."""
    bf16: bool | None = None
    """bf16 mixed precision (policy/precision.py). None: where the hardware computes bf16 natively (CUDA, a CPU
    with AVX512-BF16 or AMX; TRL's None means True everywhere); True: on any CPU too; False: float32."""
    model_init_kwargs: dict | None = None
    """Keyword arguments of `from_pretrained` when the trainer loads `model` (TRL's), a dict or its JSON text, e.g.
    {"attn_implementation": "sdpa"}. "dtype" (or "torch_dtype"): "bfloat16" is bf16=True, "float32" bf16=False,
    "auto" leaves it to `bf16`. "quantization_config" and "device_map" are the trainer's (load_in_4bit)."""
    bf16_weights: bool = False
    """Full fine-tuning keeps bf16 weights and gradients, updated with stochastic rounding (not TRL's; needs
    use_lora=false; docs/memory-planner.md, "bf16 weights")."""

    # --- optimisation ---
    learning_rate: float = 1e-6
    """Peak learning rate of the optimizer."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    lr_scheduler_type: str = "linear"
    """transformers' learning-rate schedule, with its meaning: "linear", "cosine", "cosine_with_restarts",
    "polynomial", "constant" (no warmup, as in transformers), "constant_with_warmup", "inverse_sqrt",
    "cosine_with_min_lr", "cosine_warmup_with_min_lr" or "warmup_stable_decay"."""
    lr_scheduler_kwargs: dict | None = None
    """The schedule's own keyword arguments (transformers' scheduler_specific_kwargs), a dict or its JSON text,
    e.g. {"min_lr_rate": 0.1} for "cosine_with_min_lr" or {"num_cycles": 2} for "cosine_with_restarts"."""
    warmup_ratio: float = 0.0  # not TRL 1.16's (transformers 5 folded it into warmup_steps)
    """Fraction of the optimizer steps spent warming the learning rate up linearly from 0."""
    warmup_steps: float = 0.0
    """Optimizer steps warming the learning rate up linearly from 0 (transformers 5's setting): a whole number
    of steps, or below 1 a fraction of them, as warmup_ratio. Set one of the two."""
    optim: str = "adamw_8bit"  # TRL: "adamw_torch_fused"; 8-bit here: a quarter of the state memory
    """Optimizer: "adamw_8bit" (bitsandbytes, 4x smaller state) or "adamw" (torch). transformers' names are taken
    and stored as ours: "adamw_torch" and "adamw_torch_fused" are "adamw", "adamw_bnb_8bit" is "adamw_8bit"."""
    max_nonfinite_steps: int = 3
    """Stop after this many optimizer steps in a row with a NaN/inf loss or gradient norm (each is skipped)."""

    # --- batch and schedule ---
    per_device_train_batch_size: int = 8
    """Completions per micro-batch on each rank (TRL 1.16's meaning; TRL < 0.16 counted prompts)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (completions per step = this x per_device_train_batch_size x ranks)."""
    steps_per_generation: int | None = None
    """Micro-batches sampled together as one generation batch (None: gradient_accumulation_steps, or from
    generation_batch_size); a multiple of gradient_accumulation_steps here (TRL also allows others)."""
    generation_batch_size: int | None = None
    """Completions per generation batch over all ranks (None: per_device_train_batch_size x ranks x
    steps_per_generation); advantages are computed over it. Set at most one of the two."""
    num_generations: int = 8
    """Completions sampled per prompt (the group size G of GRPO)."""
    num_train_epochs: float = 1.0  # TRL: 3.0 (transformers'); one pass is the usual GRPO run
    """Passes over the training prompts (ignored when max_steps > 0)."""
    max_steps: int = -1
    """Number of optimizer steps; when > 0 it overrides num_train_epochs."""
    seed: int = 42
    """Seed for data order, sampling and initialisation."""
    data_seed: int | None = None
    """Seed of the order the training prompts are drawn in (transformers' data_seed); None: `seed`."""
    shuffle_dataset: bool = True
    """Draw the training prompts in a seeded order, new each epoch (TRL's; a stream's by datasets' buffer)."""
    pad_to_multiple_of: int | None = None
    """Pad each micro-batch's prompts and completions to a multiple of this many tokens, masked (TRL's)."""

    # --- sampling ---
    max_prompt_length: int | None = 512  # TRL 1.16 has none (it leaves prompts whole): a bound on memory here
    """Prompts longer than this (in tokens) are cut from the left, with a one-time warning. None leaves them
    whole (older TRL's None); the memory plan then counts prompts at 512 tokens."""
    max_completion_length: int = 512
    """Most tokens generated per completion."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are computed at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 disables it)."""
    top_k: int = 0
    """Sample only from the k most likely tokens (0 disables it)."""
    min_p: float | None = None
    """Min-p sampling: drop tokens below min_p x the top token's probability, after temperature (None: off)."""
    repetition_penalty: float = 1.0
    """Penalize tokens already in the prompt or the completion so far (transformers' rule): > 1 discourages
    repeating, < 1 encourages it, 1.0 disables it. Applied before temperature."""
    generation_kwargs: dict | None = None
    """Sampling settings that override the ones above (TRL's), a dict or its JSON text: temperature, top_p, top_k,
    min_p, repetition_penalty (and do_sample=true); other keys (num_beams...) are refused: decoding here is not
    model.generate. Its temperature changes sampling only: the loss's log-probs use `temperature`, as in TRL."""
    chat_template_kwargs: dict | None = None
    """Extra keyword arguments of the tokenizer's apply_chat_template for chat prompts, training and evaluation
    alike (a dict or its JSON text), e.g. {"enable_thinking": false} for Qwen3."""
    stop_at_eos: bool = True
    """End completions at EOS; False always samples max_completion_length tokens (benchmarks: equal work)."""
    max_tool_calling_iterations: int | None = None
    """With tools (`Trainer(tools=..., environment_factory=...)`): the rounds of tool calls a completion may make
    (None: no limit but max_completion_length, which bounds the whole completion, tool output included; TRL's)."""

    int8_sampling_weights: bool = False
    """Sample with int8 copies of the weights, made after each optimizer step (grpo's own; CPU, float32,
    Llama/Mistral/Qwen2 only); the importance-sampling correction (`vllm_importance_sampling_*`) applies as to a
    vLLM server's samples (docs/inference-engines.md, "Sampling on int8 weights")."""

    # --- sampling on a vLLM server (TRL's names, meanings and defaults; docs/inference-engines.md) ---
    use_vllm: bool = False
    """Sample the completions on a vLLM server (`vllm_mode="server"`) instead of our decode loop on the policy."""
    vllm_mode: str = "colocate"
    """TRL's: "server" (a vLLM server started apart, `vllm_server_*`) or "colocate" (vLLM inside the trainer's
    process, which is refused here: vLLM runs in its own environment, never imported by grpo)."""
    vllm_server_base_url: str | None = None
    """The server's base URL (e.g. "http://localhost:8000"); when set, vllm_server_host and _port are ignored."""
    vllm_server_host: str = "0.0.0.0"
    """The server's host, when vllm_server_base_url is not set."""
    vllm_server_port: int = 8000
    """The server's port, when vllm_server_base_url is not set."""
    vllm_server_timeout: float = 240.0
    """Seconds to wait for the server to be up at the start (TRL's meaning); here also the longest a request may
    go unanswered mid-run before the run stops (one line, a checkpoint saved)."""
    vllm_importance_sampling_correction: bool = True
    """Reweight the loss by the ratio of the trainer's and the server's log-probs of the sampled tokens
    (TRL's importance-sampling correction; algo/sampling_correction.py); with int8_sampling_weights, the int8
    sampler's log-probs."""
    vllm_importance_sampling_mode: str = "sequence_mask"
    """token_truncate, token_mask, sequence_truncate or sequence_mask: per-token or per-sequence ratios, clipped
    to [clip_min, clip_max] (truncate) or set to 0 outside it (mask)."""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """The ratios' upper bound C_max (None: none)."""
    vllm_importance_sampling_clip_min: float | None = None
    """The ratios' lower bound C_min (None: none)."""

    # --- algorithm ---
    beta: float = 0.0
    """Weight of the k3 KL penalty to the reference model (0: no reference model, no reference forward)."""
    sync_ref_model: bool = False
    """TR-DPO (TRL's): mix the policy into the reference copy (full fine-tuning, beta > 0) every few steps."""
    ref_model_mixup_alpha: float = 0.6
    """With sync_ref_model: the reference becomes alpha x the policy + (1 - alpha) x itself."""
    ref_model_sync_steps: int = 512
    """With sync_ref_model: mix every this many optimizer steps."""
    epsilon: float = 0.2
    """Lower clip range: the ratio is clipped at 1 - epsilon (and at 1 + epsilon when epsilon_high is unset)."""
    epsilon_high: float | None = None
    """Upper clip range: the ratio is clipped at 1 + epsilon_high; None: epsilon (DAPO's clip-higher: 0.28).
    With loss_type="cispo" it is the weight's upper bound itself (MiniMax-M1's eps_max, e.g. 5.0)."""
    delta: float | None = None
    """Two-sided clipping (INTELLECT-2): also bound the unclipped ratio at delta, so that a negative advantage's
    loss stays bounded (None: off; TRL advises delta > 1 + epsilon)."""
    num_iterations: int = 1
    """Optimizer passes over each generation batch (mu in the GRPO paper)."""
    dynamic_sampling: bool = False  # not TRL's (it has none); verl calls it algorithm.filter_groups
    """DAPO's dynamic sampling: groups whose rewards are all equal (no learning signal) are replaced by newly
    sampled ones, for at most dynamic_sampling_max_rounds extra rounds (docs/recipes-and-settings.md)."""
    dynamic_sampling_max_rounds: int = 3
    """Extra sampling rounds one generation batch may take under dynamic_sampling (verl: max_num_gen_batches)."""
    async_generation: bool = False  # TRL has a separate AsyncGRPOTrainer (vLLM server) for this
    """Sample the next generation batch in a sampler process while the current one trains, with weights up to
    max_staleness optimizer steps old (docs/recipes-and-settings.md, "Sampling ahead"). CPU, one process only."""
    max_staleness: int = 1  # TRL AsyncGRPOConfig's name
    """With async_generation: the most optimizer steps the weights a batch is sampled with may lag the step
    that trains on it; 0 waits for every batch (the synchronous step, bit for bit)."""
    scale_rewards: str = "group"
    """Advantage scaling: "group" std, "batch" std, or "none" (Dr. GRPO); TRL's True / False are "group" / "none"."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """Several reward functions (TRL's): "sum_then_normalize" their weighted sum's advantages as scale_rewards says,
    "normalize_then_sum" each one's normalized in its group, weighted, summed, then normalized over the batch."""
    loss_type: str = "dapo"
    """How per-token losses are normalized (grpo.algo.loss): "dapo" (by the step's tokens), "grpo" (each
    completion's token mean, then their mean), "bnpo" (by each micro-batch's own tokens), "dr_grpo" (by
    max_completion_length x completions), "luspo" (completion sums); "cispo", "sapo" and "vespo" change the
    objective (cispo and vespo normalized as dapo)."""
    importance_sampling_level: str = "token"
    """Importance ratio per "token", or per "sequence" (GSPO: exp of the mean log-ratio of the completion)."""
    use_bias_correction_kl: bool = True
    """Multiply the per-token k3 KL by the (differentiable) importance ratio: the unbiased KL gradient
    (DeepSeek-V3.2); it changes the gradient whenever beta > 0, also on-policy."""
    mask_truncated_completions: bool = False
    """Leave completions that hit max_completion_length without EOS out of the loss (DAPO)."""
    top_entropy_quantile: float = 1.0
    """Train the policy term only on this top share of completion tokens by entropy (0.2 in "Beyond the
    80/20 rule"; 1.0 keeps every token). Per micro-batch (and rank) here; TRL gathers the ranks."""
    entropy_coef: float = 0.0
    """Entropy bonus: minus entropy_coef x the policy term's tokens' mean entropy (0: none; all rows get a gradient)."""
    use_adaptive_entropy: bool = False
    """TRL's adaptive entropy control (policy/gradients.EntropyControl): entropy_coef moves each step."""
    entropy_coef_min: float = 0.0
    """With use_adaptive_entropy: the coefficient's lower bound."""
    entropy_coef_max: float = 1.0
    """With use_adaptive_entropy: the coefficient's upper bound."""
    entropy_coef_delta: float = 0.005
    """With use_adaptive_entropy: the coefficient's change per optimizer step."""
    entropy_target: float = 0.2
    """With use_adaptive_entropy: the coefficient grows while the mean token entropy is at or below this."""
    off_policy_mask_threshold: float | None = None
    """DeepSeek-V3.2's off-policy sequence mask: drop the policy loss of completions with a negative advantage
    whose mean per-token KL(old || current) exceeds this (e.g. 0.5; None: off). Acts only when the policy has moved
    since sampling (num_iterations > 1, or steps_per_generation > gradient_accumulation_steps)."""
    sapo_temperature_neg: float = 1.05
    """loss_type="sapo": the gate's temperature for tokens with advantage <= 0."""
    sapo_temperature_pos: float = 1.0
    """loss_type="sapo": the gate's temperature for tokens with advantage > 0."""
    vespo_k_pos: float = 2.0
    """loss_type="vespo": the shape k of the gamma weight phi(w) = e^lambda w^k e^(-lambda w) for advantages >= 0."""
    vespo_lambda_pos: float = 3.0
    """loss_type="vespo": the rate lambda of the gamma weight for advantages >= 0."""
    vespo_k_neg: float = 3.0
    """loss_type="vespo": the shape k of the gamma weight for advantages < 0."""
    vespo_lambda_neg: float = 2.0
    """loss_type="vespo": the rate lambda of the gamma weight for advantages < 0."""
    router_aux_loss_coef: float | None = None
    """Weight of a mixture-of-experts router's load-balancing loss (TRL's); None: the model config's, 0: none."""
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
    disable_dropout: bool = False
    """Set every torch.nn.Dropout of the policy to p = 0, LoRA's lora_dropout included (as TRL does): train-mode
    forwards are then deterministic, so the loss's log-probs are the very ones its old log-probs were taken of."""
    lora_target_modules: list[str] | str | None = None
    """Module names to adapt, or "all-linear" (peft's: every linear layer except the output head, also what None
    means here)."""
    gradient_checkpointing: bool = True
    """Recompute activations in backward instead of storing them."""
    logprob_chunk_size: int = LOGPROB_CHUNK_SIZE
    """Token rows per chunk of LM-head logits when computing log-probs (bounds logits memory)."""
    shared_prompt_forward: bool | None = None
    """Training-side log-prob forwards run each distinct prompt once and its completions against its KV cache:
    the same log-probs and gradients as whole rows (docs/recipes-and-settings.md). None: on without
    gradient_checkpointing, off with it; True: on with it too."""
    load_in_4bit: bool = False
    """QLoRA: load `model` as 4-bit NF4 (bitsandbytes) under LoRA; applies when the trainer loads `model` itself."""
    cast_lm_head_to_fp32: bool = False
    """The LM heads of policy and reference in float32, their logits too (TRL's; ScaleRL): changes bf16 heads only."""

    # --- logging and checkpoints ---
    logging_steps: int = 1  # TRL: 10; a metrics line is cheap and short runs need every point
    """Write a metrics.jsonl line (and completions.jsonl rows) every this many optimizer steps."""
    save_strategy: str = "steps"
    """When checkpoints are written (transformers'): "steps" every save_steps optimizer steps, "epoch" after each
    pass over the training prompts, both also at the end; "no": never, not even when a signal or an error stops
    the run (`Trainer.save_model` still writes the model)."""
    save_steps: int = 500
    """With save_strategy="steps", save a checkpoint every this many optimizer steps (and always at the end)."""
    save_total_limit: int | None = None
    """Keep at most this many checkpoints, deleting the oldest (None keeps all)."""
    resume_from_checkpoint: str | bool | None = None
    """Continue from this checkpoint folder; "latest": the newest loadable one in output_dir, or step 0 when there
    is none yet; True (transformers'): the newest one, an error when there is none; False or None: a fresh run."""
    report_to: str | list[str] = "none"
    """Trackers that also receive the config, every metrics.jsonl line and completion samples: "tensorboard",
    "trackio", "wandb", several (a list or comma-separated), or "none" (docs/recipes-and-settings.md)."""
    log_completions: bool = False
    """Every logging step, print a sample of completions with their rewards and advantages (with rich when
    installed) and log it as a table to the trackers of `report_to`."""
    num_completions_to_print: int | None = None
    """Completions in that sample, taken from the start of the generation batch (None: all of them)."""

    # --- multi-GPU (torchrun) ---
    fsdp: bool = False  # TRL: a string of transformers FSDP options ("full_shard ..."); one switch here
    """Under torchrun: shard weights, gradients and optimizer state over ranks (FSDP2), not replicate (DDP)."""

    # --- evaluation ---
    eval_strategy: str = "no"
    """When to evaluate (greedy, on the eval dataset): "steps" every `eval_steps` optimizer steps and at the end,
    "epoch" at the end of each pass over the training prompts and at the end, "no" never (transformers')."""
    eval_steps: int | None = None  # transformers also takes a float below 1 (a share of the steps); steps here
    """With eval_strategy="steps": evaluate every this many optimizer steps (None: every `logging_steps`, as in
    transformers)."""
    eval_on_start: bool = False
    """Also evaluate before the first GRPO step (step 0), whatever eval_strategy says, so one run's metrics show
    GRPO's own gain."""
    eval_limit: int | None = None
    """Evaluate on the first this many eval prompts only (None: all of them)."""
    per_device_eval_batch_size: int | None = None  # TRL: 8; here the memory plan sizes it unless set
    """Completions per batch of greedy eval generation on each device (TRL's meaning), one per prompt (None: as
    many as the memory plan fits beside training within its peak, counted at max_prompt_length +
    max_completion_length; 64 where the model's architecture cannot be read)."""
    eval_accuracy_func: str | None = None
    """Reward function (by name) whose full marks (>= 1.0) count an eval completion as correct, `eval/accuracy`
    (None: skip; each reward function's mean is logged whatever these say); the GSM8K recipes name
    "answer_accuracy_reward"."""
    eval_format_func: str | None = None
    """Reward function (by name) whose full marks count an eval completion as well-formatted, `eval/format` (None:
    skip); the GSM8K recipes name "xml_format_reward"."""
    eval_free_accuracy_func: str | None = None
    """Function whose full marks count an eval completion correct whatever its format, `eval/free_accuracy` (None:
    skip): a reward function (by name) or an importable module.function, e.g. grpo.tasks.gsm8k.last_number_accuracy."""
    eval_breakdown_column: str | None = None
    """Eval dataset column whose values each get their own eval metrics, `eval/<column>=<value>/*` (None)."""

    def __post_init__(self):
        check_config(self)  # each field, then the settings that cannot work together (checks.py)

    def sampling_knobs(self) -> SamplingKnobs:
        """The sampling knobs of every decode that samples: the sampling fields, each overridden by its
        generation_kwargs entry if any (checked on creation), so every caller samples alike. They shape sampling
        only, as in TRL: the loss scores the policy's own distribution at `temperature`."""
        overrides = self.generation_kwargs or {}
        return SamplingKnobs(**{f.name: overrides.get(f.name, getattr(self, f.name))
                                for f in dataclasses.fields(SamplingKnobs)})

    def loss_settings(self) -> dict:
        """The keywords of `grpo.algo.loss.policy_loss` that settings decide (`LossSettings`'s fields). An unset
        epsilon_high is epsilon (TRL), resolved here and never stored, so --epsilon and --epsilon_high commute."""
        same = ("delta", "beta", "use_bias_correction_kl", "importance_sampling_level", "top_entropy_quantile",
                "entropy_coef", "use_adaptive_entropy", "off_policy_mask_threshold", "sapo_temperature_pos",
                "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
                "max_completion_length")  # LossSettings' fields of the Config's names, in its order
        return dict(loss_type=self.loss_type, epsilon_low=self.epsilon,
                    epsilon_high=self.epsilon if self.epsilon_high is None else self.epsilon_high,
                    **{name: getattr(self, name) for name in same})

