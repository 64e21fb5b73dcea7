"""A recipe for benchmarks/identical_runs.py's `server` run: recipes/tiny.py's task and rewards (of the tree the
run's cwd is), sampled by a real vLLM server (use_vllm=True, vllm_mode="server") on tests/server_setup.py's
model, LoRA r8. The environment names the server: GRPO_VLLM_URL and GRPO_VLLM_MODEL, as for the server tests.

    bash .ci/vllm_venv.sh install /tmp/vllm-venv && python tests/server_setup.py /tmp/vllm-model
    bash .ci/vllm_venv.sh serve /tmp/vllm-model 8011 /tmp/vllm-venv
    GRPO_VLLM_URL=http://127.0.0.1:8011 GRPO_VLLM_MODEL=/tmp/vllm-model python -m grpo.train \
        benchmarks/server_recipe.py
"""
import os
import runpy
from dataclasses import replace

tiny = runpy.run_path("recipes/tiny.py")
reward_funcs, train_dataset = tiny["reward_funcs"], tiny["train_dataset"]
config = replace(tiny["config"], model=os.environ["GRPO_VLLM_MODEL"], use_vllm=True, vllm_mode="server",
                 vllm_server_base_url=os.environ["GRPO_VLLM_URL"], use_lora=True, lora_r=8, lora_dropout=0.0,
                 learning_rate=5e-2, per_device_train_batch_size=8, max_prompt_length=16, max_completion_length=8)
