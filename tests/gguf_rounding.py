"""What GGUF's rounding does to a weight, for the tests that compare a written file with the model rounded alike
(tests/unit/test_gguf_export.py, tests/system/test_export.py)."""
import torch

from grpo.policy.gguf_export import GGUF_TYPES, encoded, gguf_module, tensor_type


def rounded_like_gguf(w: torch.Tensor, type_name: str) -> torch.Tensor:
    """`w` [out, in] as it reads back from a GGUF of `type_name`."""
    gguf = gguf_module()
    qtype = tensor_type(gguf, w, getattr(gguf.GGMLQuantizationType, GGUF_TYPES[type_name][0]))
    data, raw = encoded(gguf, w.detach().to("cpu", torch.float32), qtype)
    values = gguf.quants.dequantize(data, raw) if raw is not None else data.astype("float32")
    return torch.from_numpy(values.reshape(w.shape).copy()).to(w.dtype)
