"""Log-probs and sampling logits against each family's own forward, on the tiny random configs of
tests/unit/test_model_families.py (LM head x20, so that logits have a trained model's size of ~10).

    python benchmarks/head_transforms.py            # a markdown table, ~1 minute on one CPU thread

Columns: the transform read from the config (policy/head.py); the largest |log-prob - log_softmax(model logits)|
over completion tokens without the transform (what grpo computed before it knew them) and with it; the largest
|sampling logit - the model's last-position logit|. FalconH1 is here but not in the test: building it takes ~30 s.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "unit")]

from test_model_families import FAMILIES, left_padded_batch, tiny_family  # noqa: E402
from transformers.utils import logging  # noqa: E402

from grpo.algo.logprobs import token_logprobs  # noqa: E402
from grpo.policy.head import head_transform  # noqa: E402
from grpo.policy.models import completion_logprobs  # noqa: E402
from grpo.rollout.engines.decoding import head_logits, positions  # noqa: E402


def main() -> None:
    logging.set_verbosity_error()
    FAMILIES["falcon_h1"] = dict(lm_head_multiplier=0.25)
    P, tau = 5, 1.0
    print("| model_type | class | transform | before | after | sampling logits |")
    print("|---|---|---|---|---|---|")
    for model_type in sorted(FAMILIES):
        model, (ids, mask) = tiny_family(model_type), left_padded_batch()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits.float()
            reference = torch.log_softmax(logits[:, P - 1:-1] / tau, -1).gather(-1, ids[:, P:, None]).squeeze(-1)
            after = completion_logprobs(model, ids, mask, P, temperature=tau, chunk_size=7)  # [N, C]
            hidden = model.base_model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                                      use_cache=False).last_hidden_state  # [N, P+C, H]
            head = model.get_output_embeddings()
            before = token_logprobs(hidden[:, P - 1:-1], head.weight, ids[:, P:], temperature=tau, bias=head.bias)
            sampling = head_logits(model)(hidden[:, -1])  # [N, V]
        real = mask[:, P:].bool()
        t = head_transform(model.config)
        print(f"| {model_type} | {type(model).__name__} | scale {t.scale:g}, softcap {t.softcap} "
              f"| {(before - reference)[real].abs().max():.2g} | {(after - reference)[real].abs().max():.2g} "
              f"| {(sampling - logits[:, -1]).abs().max():.2g} |", flush=True)


if __name__ == "__main__":
    main()
