"""A mixture-of-experts model's router load-balancing loss, as TRL 1.16 adds it to the GRPO loss: on when the
model's config has `output_router_logits` and the weight (`router_aux_coef`) is not 0. The loss itself is the
family's `load_balancing_loss_func` (the `aux_loss` its causal LM returns), over the whole rows
(models.completion_logprobs)."""
from __future__ import annotations

import math
import sys

from ..errors import ConfigError


def router_aux_coef(hf_model, setting: float | None) -> float:
    """The weight of `hf_model`'s load-balancing loss in the GRPO loss (0: none): `router_aux_loss_coef`
    `setting` when set, else the config's own (0 when it declares none, as Glm4-MoE's and NemotronH's); a
    weight set for a model without router logits is refused, as in TRL."""
    config = hf_model.config.get_text_config()
    if setting is not None and not math.isfinite(setting):
        raise ConfigError(f"router_aux_loss_coef must be finite, got {setting}")
    if setting and not hasattr(config, "output_router_logits"):
        raise ConfigError(f"router_aux_loss_coef is set to {setting:g} but {type(hf_model).__name__} is not a "
                          "mixture-of-experts model that returns its router logits: leave router_aux_loss_coef unset")
    if not hasattr(config, "output_router_logits"):
        return 0.0
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if setting is None else float(setting)
    if coef and not hasattr(sys.modules[type(hf_model).__module__], "load_balancing_loss_func"):
        raise ConfigError(f"{type(hf_model).__name__} has no load-balancing loss in transformers: set "
                          "router_aux_loss_coef=0")
    return coef
