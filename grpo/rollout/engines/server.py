"""Completions sampled on an inference server (TRL's `use_vllm=True, vllm_mode="server"`) behind the engines' one
interface: `ServerEngine` (docs/inference-engines.md, "Sampling on a vLLM server")."""
from __future__ import annotations

import contextlib
import json
import shutil
import socket
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from http.client import HTTPException
from pathlib import Path

import torch

from ...errors import UserError
from ...policy.lora import save_options
from ...policy.models import context_length
from ..batches import Rollout
from ..streams import PromptStreams, int64
from .chat import is_chat
from .sampling import PromptEncoder, decoded_rows, eos_token_ids, rollout_of

PROBE = "Hello, world! 12 + 30 = 42.\nThe answer: <answer> 42 </answer>"
MISMATCH_NATS = 0.5  # a first batch whose log-probs differ more per token: the server samples another model
NAN = float("nan")


class ServerError(UserError):
    """The inference server cannot be reached, serves another model, or failed mid-run."""


class VLLMServer:
    """JSON over HTTP to one vLLM OpenAI-compatible server (settings/components.ServerSettings)."""

    def __init__(self, settings):
        self.url, self.timeout = settings.base_url, settings.timeout

    def request(self, path: str, body: dict | None = None, timeout: float | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as answer:
                text = answer.read().decode()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:300]
            raise ServerError(f"the vLLM server at {self.url} refused {path} (HTTP {e.code}): {detail}") from None
        except (TimeoutError, socket.timeout):
            raise ServerError(f"the vLLM server at {self.url} did not answer {path} within vllm_server_timeout="
                              f"{self.timeout:g} s") from None
        except (urllib.error.URLError, ConnectionError, HTTPException, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ServerError(f"the vLLM server at {self.url} cannot be reached ({reason}): it stopped, or none "
                              f"runs there (start one: docs/inference-engines.md)") from None
        try:
            return json.loads(text)
        except ValueError:
            return text

    def wait_until_up(self) -> None:
        """Poll /health until it answers, for up to the timeout (TRL's vllm_server_timeout)."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self.request("/health", timeout=min(5.0, self.timeout))
                return
            except ServerError as e:
                if time.monotonic() >= deadline:
                    raise ServerError(f"no vLLM server answered at {self.url} within vllm_server_timeout="
                                      f"{self.timeout:g} s ({e}); start one (docs/inference-engines.md) or set "
                                      f"vllm_server_base_url") from None
            time.sleep(1.0)


class ServerEngine:
    """The engine on a vLLM server (module docstring). `model`: the policy (a peft model: its adapter is what the
    server loads); `encode`: the run's prompt encoder (engines/sampling.prompt_encoder); `settings`, `server`:
    settings/components.SamplingSettings and ServerSettings; `adapters_dir`: where adapters are written for the
    server to read."""

    def __init__(self, model, tokenizer, encode: PromptEncoder, settings, server, adapters_dir: Path):
        self.model, self.tokenizer, self.encode, self.settings = model, tokenizer, encode, settings
        self.eos_ids = eos_token_ids(tokenizer, model)
        self.server = VLLMServer(server)
        self.adapters_dir = Path(adapters_dir).resolve()
        self.run_id = uuid.uuid4().hex[:8]  # adapter names unique to this run, even resumed on the same server
        self.adapter: tuple[int, str] | None = None  # (step, name) the server holds
        self.checked_logprobs = False
        self.server.wait_until_up()
        self.base = self.check_model()

    def check_model(self) -> str:
        """The served model's name, after checking that it tokenizes as the trained model does."""
        models = self.server.request("/v1/models")
        name = models["data"][0]["id"]
        want = self.tokenizer(PROBE, add_special_tokens=False)["input_ids"]
        got = self.server.request("/tokenize", {"model": name, "prompt": PROBE, "add_special_tokens": False})
        if got.get("tokens") != want:
            raise ServerError(f"the vLLM server at {self.server.url} serves {name}, which tokenizes otherwise than "
                              f"the trained model: start it on the trained model's base")
        return name

    def push_adapter(self, step: int) -> str:
        """The adapter the server samples step `step` with: written and loaded once a step, the last one removed."""
        if self.adapter is not None and self.adapter[0] == step:
            return self.adapter[1]
        name = f"grpo-{self.run_id}-step{step}"
        folder = self.adapters_dir / name
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp, **save_options(self.model))
        tmp.rename(folder)
        try:
            self.server.request("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        except ServerError as e:
            raise ServerError(f"{e}; start the server with --enable-lora --max-lora-rank >= lora_r and "
                              f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, reading {self.adapters_dir}") from None
        if self.adapter is not None:
            old = self.adapter[1]
            self.server.request("/v1/unload_lora_adapter", {"lora_name": old})
            shutil.rmtree(self.adapters_dir / old, ignore_errors=True)
        self.adapter = (step, name)
        return name

    def close(self) -> None:
        """The run has ended (or stopped): the adapter the server holds unloaded, unless the server does not
        answer within seconds, and `adapters_dir` removed (a killed run's leftovers too: run/lock)."""
        if self.adapter is not None:
            with contextlib.suppress(ServerError):
                self.server.request("/v1/unload_lora_adapter", {"lora_name": self.adapter[1]},
                                    timeout=min(5.0, self.server.timeout))
            self.adapter = None
        shutil.rmtree(self.adapters_dir, ignore_errors=True)

    def complete(self, adapter: str, prompt: list[int], seed: int, n: int, max_tokens: int, stop: list[str],
                 on_token) -> list[tuple[list[int], list[float]]]:
        """`n` completions of `prompt` (token ids) by the server, with the run's sampling knobs, as (token ids, their
        sampled log-probs); with `stop`, each ends after the first of those strings it writes."""
        s, knobs = self.settings, self.settings.knobs
        body = {"model": adapter, "prompt": prompt, "n": n, "max_tokens": max_tokens,
                "temperature": knobs.temperature, "top_p": knobs.top_p,
                "top_k": knobs.top_k if knobs.top_k > 0 else -1, "min_p": knobs.min_p or 0.0,
                "repetition_penalty": knobs.repetition_penalty, "seed": seed, "logprobs": 0,
                "return_token_ids": True}
        body.update({"stop_token_ids": self.eos_ids} if s.stop_at_eos else {"ignore_eos": True})
        if stop:  # the server stops there (and keeps it)
            body.update(stop=stop, include_stop_str_in_output=True)
        choices = sorted(self.server.request("/v1/completions", body)["choices"], key=lambda c: c["index"])
        out = [(c["token_ids"], [NAN if v is None else v for v in c["logprobs"]["token_logprobs"]]) for c in choices]
        if on_token is not None:
            on_token(sum(len(ids) for ids, _ in out))
        return out

    @torch.no_grad()
    def __call__(self, prompts: list, on_token=None, streams: PromptStreams | None = None,
                 envs: list | None = None) -> tuple[Rollout, dict[str, list]]:
        s, G = self.settings, self.settings.num_generations
        streams = streams if streams is not None else PromptStreams(s.seed)
        adapter = self.push_adapter(streams.step)
        prompt_ids, prompt_mask = self.encode(prompts, context_length(self.model), s.max_completion_length,  # [B, P]
                                              None if envs is None else envs[::G])  # each prompt's tools its env's
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        loop = self.encode.tool_loop(prompts, G, s.max_tool_calling_iterations, envs, self.eos_ids)
        if loop is None:  # each prompt's G completions from its seed, the prompts at once
            seeds = streams.seeds(len(prompts), 1).tolist()  # [B]
            with ThreadPoolExecutor(max_workers=min(32, len(rows))) as pool:
                sampled = [c for group in pool.map(lambda i: self.complete(
                    adapter, rows[i], seeds[i], G, s.max_completion_length, [], on_token), range(len(rows)))
                    for c in group]  # N = B * G
            decoded = decoded_rows([ids for ids, _ in sampled], self.tokenizer.pad_token_id, self.eos_ids,
                                   logprobs=[lps for _, lps in sampled])
        else:  # each completion in segments from its own seed, through the tool loop
            seeds, stops = streams.seeds(len(prompts), G).tolist(), [t.trigger for t in self.encode.tools.inline]
            tool_rows = [ServerToolRow(loop, i, rows[i // G], seeds[i], s.max_completion_length, self.eos_ids, stops)
                         for i in range(len(rows) * G)]
            sample_rows(tool_rows, lambda prompt, seed, room, stop: self.complete(
                adapter, prompt, seed, 1, room, stop, on_token)[0])
            decoded = decoded_rows([r.ids for r in tool_rows], self.tokenizer.pad_token_id, None,
                                   fed=[r.fed for r in tool_rows], logprobs=[r.logprobs for r in tool_rows])
        rollout = rollout_of(prompt_ids, prompt_mask, decoded, self.tokenizer, self.eos_ids, chat=is_chat(prompts[0]),
                             loop=loop, repeats=G)
        return rollout.to(next(self.model.parameters()).device), {}

    def corrected(self, generation, settings) -> dict[str, float]:
        """The importance-sampling correction of `generation` (rollout/batches.Generation.correct_sampling) and its
        metrics; on the first batch, a server whose log-probs are far from the policy's serves another model."""
        metrics = generation.correct_sampling(settings)
        difference = metrics["sampling/sampling_logp_difference/mean"]
        if not self.checked_logprobs and difference > MISMATCH_NATS:
            raise ServerError(f"the vLLM server at {self.server.url} serves {self.base}, whose log-probs of its own "
                              f"samples differ from the trained model's by {difference:.2f} nats per token: it "
                              f"serves another model (or runs without --logprobs-mode processed_logprobs)")
        self.checked_logprobs = True
        return metrics


class ServerToolRow:
    """One completion row `row` of `loop` (a ToolLoop), sampled one segment at a time: `request()` says what to
    sample next (None once done), `take(tokens, logprobs)` runs the segment through the loop, in the caller's thread."""

    def __init__(self, loop, row: int, prompt: list[int], seed: int, width: int, eos_ids: list[int],
                 stops: list[str]):
        self.loop, self.row, self.prompt, self.seed = loop, row, prompt, seed
        self.width, self.eos, self.stops = width, set(eos_ids), stops
        self.ids, self.fed, self.logprobs = [], [], []  # fed: 1 on the tokens a tool wrote, 0 on the model's
        self.segments, self.done = 0, False

    def request(self) -> tuple[list[int], int, int, list[str]] | None:
        room = self.width - len(self.ids)
        if self.done or room <= 0:
            self.done = True
            return None
        self.segments += 1
        return self.prompt + self.ids, int64(self.seed + self.segments - 1), room, self.stops

    def take(self, tokens: list[int], logprobs: list[float]) -> None:
        """The segment's tokens, up to the first a tool reacts to (its output appended) or that ends the row."""
        if not tokens:
            self.done = True
            return
        for token, logprob in zip(tokens, logprobs):
            self.ids.append(token), self.fed.append(0), self.logprobs.append(logprob)
            (ends,), fed = self.loop.row_ends([self.row], [token], [self.width - len(self.ids)], [token in self.eos])
            if self.row in fed:  # a tool ran: its output appended, the next segment starts after it
                self.ids += fed[self.row]
                self.fed += [1] * len(fed[self.row])
                self.logprobs += [NAN] * len(fed[self.row])
            if ends or self.row in fed:
                self.done = ends
                return


def sample_rows(rows: list[ServerToolRow], sample, workers: int = 32) -> None:
    """Sample every row to its end: each row's segments in order, the rows' requests at once (threads), their
    tokens taken in this thread as the answers come."""
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(rows)))) as pool:
        pending = {pool.submit(sample, *r.request()): r for r in rows}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                row = pending.pop(future)
                row.take(*future.result())
                nxt = row.request()
                if nxt is not None:
                    pending[pool.submit(sample, *nxt)] = row
