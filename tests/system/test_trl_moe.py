"""TRL 1.16's mixture-of-experts router load-balancing loss, ported by changing the import lines: TRL's own
`test_train` on its MoE families (tiny random stand-ins of GPT-OSS, Qwen3-MoE, Glm4-MoE and NemotronH), the loss
holding the router's term, and its setting's refusals."""
import pytest
from test_trl_everyday import trl_args as everyday_args
from tiny_setup import MOE_FAMILIES, digit_prompts, digit_share, tiny_model, tiny_moe, tiny_tokenizer

# was: from trl import GRPOTrainer (and GRPOConfig, in trl_args)
from grpo import Trainer as GRPOTrainer
from grpo.errors import ConfigError


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def trl_args(tmp_path, **settings):
    """TRL's tests' keywords (tests/system/test_trl_everyday.py), two steps unless a test says otherwise."""
    return everyday_args(tmp_path, **{"max_steps": 2, **settings})


@pytest.mark.parametrize("model_type", list(MOE_FAMILIES))
def test_train(tmp_path, tokenizer, model_type):
    trainer = GRPOTrainer(model=tiny_moe(tokenizer, model_type), processing_class=tokenizer,
                          reward_funcs=digit_share, args=trl_args(tmp_path), train_dataset=digit_prompts(6))
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    # MoE models log the load-balancing auxiliary loss (on by default where the config declares its weight)
    assert trainer.aux_loss_enabled == (model_type in ("qwen3_moe", "gpt_oss"))
    if trainer.aux_loss_enabled:
        assert trainer.state.log_history[-1]["aux_loss"] is not None
    else:
        assert "aux_loss" not in trainer.state.log_history[-1]
    # Check that the params have changed
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        assert not param.equal(new_param), f"Parameter {n} has not changed."


def test_the_loss_holds_the_routers_term_with_its_weight(tmp_path, tokenizer):
    args = trl_args(tmp_path, router_aux_loss_coef=0.5)
    trainer = GRPOTrainer(model=tiny_moe(tokenizer, "qwen3_moe"), processing_class=tokenizer,
                          reward_funcs=digit_share, args=args, train_dataset=digit_prompts(6))
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.5
    trainer.train()
    for step in [line for line in trainer.state.log_history if "aux_loss" in line]:
        # Switch Transformer's loss: E x sum_e (token share) x (mean router probability), >= 1, 1 when balanced.
        assert step["aux_loss"] >= 1.0 - 1e-6
        assert step["loss"] == pytest.approx(step["loss/policy"] + 0.5 * step["aux_loss"], abs=1e-6)


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def test_the_routers_loss_trains_rows_of_advantage_0(tmp_path, tokenizer):
    # Equal rewards: every advantage is 0, the policy term is 0, and only the router's loss is left, over every row.
    trainer = GRPOTrainer(model=tiny_moe(tokenizer, "gpt_oss"), processing_class=tokenizer,
                          reward_funcs=constant_reward, args=trl_args(tmp_path, max_steps=1),
                          train_dataset=digit_prompts(3))
    router = {n: p.clone() for n, p in trainer.model.named_parameters() if "router" in n}
    trainer.train()
    step = trainer.state.log_history[-1]
    assert step["skipped/zero_gradient"] == 0 and step["loss/policy"] == 0
    assert step["loss"] == pytest.approx(0.001 * step["aux_loss"]) and step["aux_loss"] >= 1.0 - 1e-6
    assert all(not p.equal(trainer.model.get_parameter(n)) for n, p in router.items())


def test_a_zero_weight_turns_the_routers_loss_off(tmp_path, tokenizer):
    trainer = GRPOTrainer(model=tiny_moe(tokenizer, "gpt_oss"), processing_class=tokenizer,
                          reward_funcs=digit_share, args=trl_args(tmp_path, router_aux_loss_coef=0.0, max_steps=1),
                          train_dataset=digit_prompts(3))
    trainer.train()
    assert not trainer.aux_loss_enabled and "aux_loss" not in trainer.state.log_history[-1]


def test_a_weight_for_a_model_without_router_is_refused(tmp_path, tokenizer):
    with pytest.raises(ConfigError, match="router_aux_loss_coef is set to 0.01 but Qwen2ForCausalLM is not a"):
        GRPOTrainer(model=tiny_model(tokenizer), processing_class=tokenizer, reward_funcs=digit_share,
                    args=trl_args(tmp_path, router_aux_loss_coef=0.01), train_dataset=digit_prompts(3))


def test_the_routers_loss_forwards_whole_rows(tmp_path, tokenizer, capsys):
    # TRL's router loss counts each prompt's tokens once per completion: each prompt forwarded once would not.
    trainer = GRPOTrainer(model=tiny_moe(tokenizer, "qwen3_moe"), processing_class=tokenizer,
                          reward_funcs=digit_share, args=trl_args(tmp_path, shared_prompt_forward=True),
                          train_dataset=digit_prompts(3))
    assert not trainer.policy.shared_prompt
    why = "shared_prompt_forward is off: the router's load-balancing loss is over whole rows"
    assert why in capsys.readouterr().err


def test_a_weight_for_a_family_without_a_load_balancing_loss_is_refused(tmp_path, tokenizer):
    # Glm4-MoE returns router logits but transformers computes no load-balancing loss for it (nor does TRL).
    with pytest.raises(ConfigError, match="Glm4MoeForCausalLM has no load-balancing loss in transformers: set "
                                          "router_aux_loss_coef=0"):
        GRPOTrainer(model=tiny_moe(tokenizer, "glm4_moe"), processing_class=tokenizer, reward_funcs=digit_share,
                    args=trl_args(tmp_path, router_aux_loss_coef=0.01), train_dataset=digit_prompts(3))


def test_lora_with_dropout_on_fused_experts_is_one_line(tmp_path, tokenizer):
    # peft's LoRA on Qwen3-MoE's fused expert weights takes no dropout; the Config's default lora_dropout is 0.05.
    args = trl_args(tmp_path, use_lora=True)
    with pytest.raises(ConfigError, match=r"peft cannot add this LoRA adapter .*lora_dropout != 0"):
        GRPOTrainer(model=tiny_moe(tokenizer, "qwen3_moe"), processing_class=tokenizer, reward_funcs=digit_share,
                    args=args, train_dataset=digit_prompts(6))
    trainer = GRPOTrainer(model=tiny_moe(tokenizer, "qwen3_moe"), processing_class=tokenizer, reward_funcs=digit_share,
                          args=trl_args(tmp_path / "no-dropout", use_lora=True, lora_dropout=0.0),
                          train_dataset=digit_prompts(6))
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
