"""Sampling on a real vLLM server (use_vllm=True, vllm_mode="server"): the server samples the current adapter at
every step (the trainer's and the server's log-probs of the sampled tokens agree), a seed samples the same twice,
and the failures are one line each: no server, a server of another model, a server that dies or hangs mid-run
(a checkpoint saved). Skipped unless a server runs: .ci/run starts one (.ci/vllm_venv.sh) on
`tests/server_setup.py`'s model and sets GRPO_VLLM_URL and GRPO_VLLM_MODEL (that folder)."""
import http.server
import json
import os
import signal
import socket
import threading
import time
import urllib.request

import pytest
import torch
from server_setup import server_model
from tiny_setup import digit_prompts, logged, text_length, tiny_tokenizer

from grpo import Config, Trainer
from grpo.errors import ConfigError
from grpo.rollout.engines.server import ServerError
from grpo.rollout.streams import PromptStreams

URL, MODEL = os.environ.get("GRPO_VLLM_URL"), os.environ.get("GRPO_VLLM_MODEL")
needs_server = pytest.mark.skipif(not (URL and MODEL), reason="no vLLM server: set GRPO_VLLM_URL and GRPO_VLLM_MODEL "
                                                               "(.ci/run starts one)")


def settings(out, url=URL, model=MODEL, **overrides) -> dict:
    return {**dict(model=model, output_dir=str(out), use_lora=True, lora_r=8, lora_dropout=0.0, use_vllm=True,
                   vllm_mode="server", vllm_server_base_url=url, learning_rate=5e-2, max_steps=3,
                   per_device_train_batch_size=8, num_generations=4, max_prompt_length=16, max_completion_length=8,
                   seed=0, save_strategy="no"), **overrides}


@needs_server
@pytest.mark.slow
def test_the_server_samples_the_current_adapter_every_step(tmp_path):
    """After each optimizer step the adapter moves (lr 5e-2); the server's log-probs of what it sampled stay
    those of the trainer's policy only if it samples with the adapter just written (break push_adapter to see)."""
    trainer = Trainer(Config(**settings(tmp_path / "run")), reward_funcs=[text_length], train_dataset=digit_prompts())
    trainer.train()
    lines = logged(trainer)
    assert [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:
        assert line["sampling/sampling_logp_difference/mean"] < 1e-3, line
        assert abs(line["sampling/importance_sampling_ratio/mean"] - 1) < 1e-2, line
    assert lines[-1]["skipped/zero_gradient"] < 1  # rows were trained on: the adapter changed
    assert not (tmp_path / "run" / "vllm-adapters").exists()  # the last one unloaded, the folder removed


@needs_server
@pytest.mark.slow
def test_a_seed_samples_the_same_twice_and_the_tokens_are_the_servers(tmp_path):
    trainer = Trainer(Config(**settings(tmp_path / "run")), reward_funcs=[text_length], train_dataset=digit_prompts())
    prompts = ["Write 3 digits:", "Write 7 digits:"]
    first, _ = trainer.engine(prompts, streams=PromptStreams(0, 0))
    again, _ = trainer.engine(prompts, streams=PromptStreams(0, 0))
    other, _ = trainer.engine(prompts, streams=PromptStreams(1, 0))
    assert torch.equal(first.completion_ids, again.completion_ids)
    assert not torch.equal(first.completion_ids, other.completion_ids)
    assert first.completion_ids.shape[0] == 8
    assert not torch.isnan(first.sampling_logprobs[first.completion_mask == 1]).any()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_server_is_one_line_within_the_timeout(tmp_path):
    port = free_port()
    start = time.monotonic()
    with pytest.raises(ServerError, match=rf"no vLLM server answered at http://127.0.0.1:{port} within "
                                          r"vllm_server_timeout=2 s .*start one"):
        _trainer_on_tiny(tmp_path, f"http://127.0.0.1:{port}")
    assert time.monotonic() - start < 30


def _trainer_on_tiny(tmp_path, url, **overrides):
    folder = tmp_path / "model"
    if not folder.exists():
        server_model(str(folder), **overrides.pop("build", {}))
    overrides = {"vllm_server_timeout": 2, **overrides}
    return Trainer(Config(**settings(tmp_path / "run", url=url, model=str(folder), **overrides)),
                   reward_funcs=[text_length], train_dataset=digit_prompts())


class FakeVLLM:
    """A stand-in for a vLLM server, without vLLM: it answers what a run asks (health, the model, its tokenizer,
    loading and unloading adapters, completions of digits with made-up log-probs), noting each adapter loaded with
    the files its folder held then and each one unloaded; from `fail_at` completions requests on, it answers
    those with HTTP 500."""

    def __init__(self, tokenizer, fail_at: int | None = None):
        fake = self
        self.loaded, self.unloaded, self.completions = [], [], 0

        def answer(body: dict):
            if body.get("prompt") is not None and "n" not in body:  # /tokenize
                return {"tokens": tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]}
            if "lora_path" in body:
                fake.loaded.append((body["lora_name"], sorted(os.listdir(body["lora_path"]))))
                return "Success"
            if "lora_name" in body:
                fake.unloaded.append(body["lora_name"])
                return "Success"
            fake.completions += 1
            if fail_at is not None and fake.completions >= fail_at:
                return None
            ids = tokenizer("1234567", add_special_tokens=False)["input_ids"]
            return {"choices": [{"index": i, "token_ids": ids[:1 + i % body["max_tokens"]],
                                 "logprobs": {"token_logprobs": [-1.0] * len(ids[:1 + i % body["max_tokens"]])}}
                                for i in range(body["n"])]}

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, value):
                data = b"failed" if value is None else json.dumps(value).encode()
                self.send_response(500 if value is None else 200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply({"data": [{"id": "tiny"}]} if self.path == "/v1/models" else "")

            def do_POST(self):
                self.reply(answer(json.loads(self.rfile.read(int(self.headers["Content-Length"])))))

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def ctrl_c_in_step_2(completions, trainer_state, **kwargs):
    if trainer_state.global_step == 1:
        os.kill(os.getpid(), signal.SIGINT)
    return text_length(completions)


@pytest.mark.parametrize("how", ["ends", "fails", "is-interrupted"])
def test_the_adapters_written_for_the_server_are_gone_when_the_run_ends_however_it_ends(tmp_path, how):
    # 2 prompts a step, one completions request each: the third is step 2's first
    fake = FakeVLLM(tiny_tokenizer(), fail_at=3 if how == "fails" else None)
    out = tmp_path / "run"
    trainer = _trainer_on_tiny(tmp_path, fake.url, max_steps=2, vllm_importance_sampling_correction=False,
                               save_strategy="steps", save_steps=100)
    if how == "is-interrupted":
        trainer.pipeline.source.reward_funcs = [ctrl_c_in_step_2]
    try:
        if how == "ends":
            trainer.train()
        else:
            with pytest.raises(ServerError if how == "fails" else KeyboardInterrupt):
                trainer.train()
    finally:
        fake.stop()
    assert out.exists() and not (out / "vllm-adapters").exists()
    names = [name for name, _ in fake.loaded]
    assert all("adapter_config.json" in files for _, files in fake.loaded)  # the server could read each one
    assert names == [f"grpo-{trainer.engine.run_id}-step{s}" for s in range(2)]
    assert fake.unloaded == names  # the step-0 adapter when step 1's came, the last one at the end


def test_the_settings_a_server_run_cannot_honour_are_refused_in_one_line():
    with pytest.raises(ConfigError, match='vllm_mode="colocate" is not supported: vLLM runs in its own environment'):
        Config(use_vllm=True, use_lora=True)
    with pytest.raises(ConfigError, match="use_vllm=True needs use_lora=True: .* no weight-update endpoint"):
        Config(use_vllm=True, vllm_mode="server")
    with pytest.raises(ConfigError, match="vllm_importance_sampling_mode must be one of token_truncate"):
        Config(use_vllm=True, vllm_mode="server", use_lora=True, vllm_importance_sampling_mode="token")
    with pytest.raises(ConfigError, match='loss_type="vespo" with vllm_importance_sampling_correction=True'):
        Config(use_vllm=True, vllm_mode="server", use_lora=True, loss_type="vespo")


class Proxy:
    """A stand-in in front of the real server: forwards requests until `mode` says "dead" (the port closed: a
    server that died) or "hang" (requests never answered)."""

    def __init__(self, target: str):
        proxy = self
        self.mode, self.requests = "forward", []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def forward(self, body=None):
                proxy.requests.append(self.path)
                if proxy.mode == "hang":
                    time.sleep(30)
                    return
                req = urllib.request.Request(target + self.path, data=body, headers={"Content-Type":
                                                                                      "application/json"})
                with urllib.request.urlopen(req, timeout=60) as answer:
                    data = answer.read()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.forward()

            def do_POST(self):
                self.forward(self.rfile.read(int(self.headers["Content-Length"])))

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def die(self):
        self.mode = "dead"
        self.server.shutdown()
        self.server.server_close()


@needs_server
@pytest.mark.slow
@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_server_that_dies_or_hangs_mid_run_stops_it_in_one_line_with_a_checkpoint(tmp_path, how):
    proxy = Proxy(URL)
    trainer = Trainer(Config(**settings(tmp_path / "run", url=proxy.url, vllm_server_timeout=3, max_steps=4,
                                        save_strategy="steps", save_steps=100)),
                      reward_funcs=[text_length], train_dataset=digit_prompts())
    original = trainer.updates.apply

    def apply(loss, step):  # after the second optimizer step, the server goes
        out = original(loss, step)
        if step == 1:
            proxy.die() if how == "dies" else setattr(proxy, "mode", "hang")
        return out
    trainer.updates.apply = apply
    expected = "cannot be reached" if how == "dies" else "did not answer /v1/load_lora_adapter within"
    with pytest.raises(ServerError, match=expected) as info:
        trainer.train()
    assert "\n" not in str(info.value)
    assert (tmp_path / "run" / "checkpoint-2" / "COMPLETE").exists()  # the steps done are saved
    if how == "hangs":
        proxy.die()


@needs_server
@pytest.mark.slow
def test_a_server_of_another_model_is_one_line(tmp_path):
    from grpo.tasks.tiny import train_tokenizer

    other = tmp_path / "other-tokenizer"  # a vocabulary with merges: other ids for the same text
    server_model(str(other), tokenizer=train_tokenizer(["Hello, world! The answer: <answer> 42 </answer>"] * 50,
                                                       vocab_size=300))
    with pytest.raises(ServerError, match="tokenizes otherwise than the trained model"):
        Trainer(Config(**settings(tmp_path / "run", model=str(other))), reward_funcs=[text_length],
                train_dataset=digit_prompts())
    # the same tokenizer, other weights (peaked: their log-probs are far from the served model's)
    trainer = _trainer_on_tiny(tmp_path, URL, build={"seed": 1, "initializer_range": 0.5}, vllm_server_timeout=60)
    with pytest.raises(ServerError, match=r"differ from the trained model's by \d+\.\d\d nats per token"):
        trainer.train()


def forty_two(expression):
    return "42"


@needs_server
@pytest.mark.slow
def test_an_inline_tool_runs_through_the_server_and_its_tokens_stay_out_of_the_loss(tmp_path):
    """A row stops where the tool's trigger completes, the tool's output goes back as tokens the model did not
    write (out of the loss mask, no sampled log-prob), and the row samples on after them; the run trains with the
    server's log-probs those of the policy. The trigger: a character row 0 samples anyway (same seeds)."""
    from grpo.rollout.tools import InlineTool

    def trainer(trigger: str, out):
        return Trainer(Config(**settings(out, max_steps=2, max_completion_length=24)), reward_funcs=[text_length],
                       train_dataset=digit_prompts(), tools=[InlineTool("", trigger, ">>", forty_two)])
    prompts = ["Write 3 digits:", "Write 7 digits:"]
    untouched, _ = trainer("\x00\x00", tmp_path / "a").engine(prompts, streams=PromptStreams(0, 0))
    trigger = next(ch for ch in untouched.completions[0][2:] if ch.isalnum())
    tools = trainer(trigger, tmp_path / "b")
    rollout, _ = tools.engine(prompts, streams=PromptStreams(0, 0))
    before = untouched.completions[0][:untouched.completions[0].index(trigger) + 1]
    assert rollout.completions[0].startswith(before + "42>>")  # the same sampling up to the call, then its result
    assert rollout.tool_calls[0] >= 1
    fed = (rollout.completion_mask - rollout.loss_mask)[0]  # [C]: the tool's tokens
    assert fed.sum() == len(tools.tokenizer.encode("42>>", add_special_tokens=False))
    assert torch.isnan(rollout.sampling_logprobs[0][fed == 1]).all()
    assert not torch.isnan(rollout.sampling_logprobs[rollout.loss_mask == 1]).any()
    tools.train()
    for line in logged(tools):
        assert line["tools/call_frequency"] > 0 and line["sampling/sampling_logp_difference/mean"] < 1e-3, line
