"""The names TRL's test file imports from its tests/testing_utils.py, written here (that file is not in TRL's
wheel): the same skip conditions, checked against what is installed. Never imports grpo or TRL."""
import importlib.util

import pytest
import torch


def _skip_unless(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"test requires {module}")


require_bitsandbytes = _skip_unless("bitsandbytes")
require_jmespath = _skip_unless("jmespath")
require_kernels = _skip_unless("kernels")
require_liger_kernel = _skip_unless("liger_kernel")
require_peft = _skip_unless("peft")
require_vision = _skip_unless("PIL")
require_vllm = _skip_unless("vllm")
require_torch_accelerator = pytest.mark.skipif(not torch.cuda.is_available(), reason="test requires an accelerator")


def is_ampere_or_newer() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8


class TrlTestCase:
    """TRL's base class: each test gets a fresh output folder as `self.tmp_dir`."""

    @pytest.fixture(autouse=True)
    def set_tmp_dir(self, tmp_path):
        self.tmp_dir = str(tmp_path)
